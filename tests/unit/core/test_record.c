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
    assert_int_equal(
        ts_map_set(params, "scalar", ts_tensor_new(TS_FLOAT64, 0, NULL, &(double){2.5}, TS_COPY)),
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
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* misaligned data offset */
    ts__put_u64le(meta + 13, 4);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* ndim beyond the configured limit, dtype unknown, reserved set */
    meta[2] = 9;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    memcpy(rec, saved, 64);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, 0, NULL), TS_EBADRECORD);
    meta[1] = 99;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    memcpy(rec, saved, 64);
    meta[3] = 1;
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    memcpy(rec, saved, 64);
    /* overflowing dimension */
    ts__put_u64le(meta + 5, UINT64_MAX / 2);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
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

/*
 * Fail every allocation of building, encoding and decoding a record in turn. Each run either
 * fails cleanly at the step whose allocation failed (NULL or TS_ENOMEM, never a crash, a leak or
 * a half-built result) or, once n is past the last allocation, completes with a decoded record
 * equal to the original. Both outcomes must be seen: the loop proves that every allocation of
 * the path was failed once.
 */
static void test_allocation_failures(void **state)
{
    (void)state;
    int64_t shape[1] = {8};
    int failed = 0, completed = 0;
    for (long n = 1; n < 64 && completed == 0; n++) {
        ts__alloc_fail_after(n);
        int rc = 0;
        ts_value_t *m = ts_map_new();
        if (m == NULL) {
            rc = TS_ENOMEM;
        } else {
            ts_value_t *t = ts_tensor_alloc(TS_INT32, 1, shape);
            if (t != NULL)
                memset((void *)ts_value_tensor(t)->data, 7, 8 * sizeof(int32_t));
            /* ts_map_set takes the child, and frees it on failure, NULL included. */
            rc = ts_map_set(m, "t", t);
        }
        uint8_t *rec = NULL;
        size_t len = 0;
        if (rc == 0)
            rc = ts__record_encode(m, &rec, &len);
        ts_value_t *d = NULL;
        if (rc == 0) {
            uint8_t *copy = ts__malloc_aligned(len);
            ts__rbuf *b = copy != NULL ? ts__rbuf_new(copy, len, NULL) : NULL;
            if (b != NULL) {
                memcpy(copy, rec, len);
                d = ts__record_decode(b, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
                ts__rbuf_unref(b);
            } else if (copy != NULL) {
                ts__free_aligned(copy, len);
            }
            if (d == NULL)
                rc = TS_ENOMEM;
            ts__free_aligned(rec, len);
        }
        ts__alloc_fail_after(-1);
        if (rc == 0) {
            /* Every allocation succeeded: the decoded record is the one encoded. */
            const ts_tensor_t *dt = ts_map_get_tensor(d, "t");
            assert_non_null(dt);
            assert_int_equal(dt->dtype, TS_INT32);
            assert_int_equal(dt->ndim, 1);
            assert_int_equal(dt->shape[0], 8);
            assert_memory_equal(dt->data, ts_value_tensor(ts_map_get(m, "t"))->data,
                                8 * sizeof(int32_t));
            completed++;
        } else {
            assert_int_equal(rc, TS_ENOMEM);
            assert_null(d);
            failed++;
        }
        ts_value_free(d);
        ts_value_free(m);
    }
    /* At least the map, the tensor, the encode buffer and the decode each allocate. */
    assert_true(failed >= 4);
    assert_int_equal(completed, 1);
}

/* ----------------------------------------------------------------------------------------------
 * Hand-built records: a small writer for meta bytes, so every validator rule can be hit alone.
 */

typedef struct mbuf {
    uint8_t b[1024];
    size_t n;
} mbuf;

static void mb_u8(mbuf *m, uint8_t v)
{
    assert_true(m->n + 1 <= sizeof(m->b));
    m->b[m->n++] = v;
}

static void mb_u16(mbuf *m, uint16_t v)
{
    assert_true(m->n + 2 <= sizeof(m->b));
    ts__put_u16le(m->b + m->n, v);
    m->n += 2;
}

static void mb_u32(mbuf *m, uint32_t v)
{
    assert_true(m->n + 4 <= sizeof(m->b));
    ts__put_u32le(m->b + m->n, v);
    m->n += 4;
}

static void mb_u64(mbuf *m, uint64_t v)
{
    assert_true(m->n + 8 <= sizeof(m->b));
    ts__put_u64le(m->b + m->n, v);
    m->n += 8;
}

static void mb_key(mbuf *m, const char *k)
{
    size_t n = strlen(k);
    mb_u16(m, (uint16_t)n);
    assert_true(m->n + n <= sizeof(m->b));
    memcpy(m->b + m->n, k, n);
    m->n += n;
}

static void mb_tensor(mbuf *m, uint8_t dtype, uint8_t ndim, const uint64_t *dims, uint64_t off,
                      uint64_t len)
{
    mb_u8(m, TS_TYPE_TENSOR);
    mb_u8(m, dtype);
    mb_u8(m, ndim);
    mb_u16(m, 0);
    for (int i = 0; i < ndim; i++)
        mb_u64(m, dims[i]);
    mb_u64(m, off);
    mb_u64(m, len);
}

static void mb_bytes(mbuf *m, uint64_t off, uint64_t len)
{
    mb_u8(m, TS_TYPE_BYTES);
    mb_u64(m, off);
    mb_u64(m, len);
}

/*
 * A record around meta with a zeroed data area of data_len bytes; *len receives its length.
 * Free with ts__free_aligned(rec, len).
 */
static uint8_t *mk_record(const mbuf *m, uint64_t data_len, size_t *len)
{
    size_t start = ts__align_up(TS_REC_HDR_SIZE + m->n, TS__ALIGN);
    *len = start + (size_t)data_len;
    uint8_t *rec = ts__malloc_aligned(*len);
    assert_non_null(rec);
    memset(rec, 0, *len);
    rec[0] = 'T';
    rec[1] = 'S';
    rec[2] = 'R';
    rec[3] = 0x01;
    ts__put_u32le(rec + 4, (uint32_t)m->n);
    ts__put_u64le(rec + 8, data_len);
    memcpy(rec + TS_REC_HDR_SIZE, m->b, m->n);
    return rec;
}

/* Validate meta (with a data area of data_len bytes) at the protocol's limits. */
static int check_meta(const mbuf *m, uint64_t data_len)
{
    size_t len;
    uint8_t *rec = mk_record(m, data_len, &len);
    int rc = ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL);
    if (rc == 0) {
        /* Whatever validates must decode, and whatever decodes must have validated. */
        ts__rbuf *b;
        ts_value_t *d = decode_copy(rec, len, &b);
        assert_non_null(d);
        ts_value_free(d);
        ts__rbuf_unref(b);
    }
    ts__free_aligned(rec, len);
    return rc;
}

/* Encode, validate, decode; the caller frees *rec (ts__free_aligned) and *buf. */
static ts_value_t *round_trip(const ts_value_t *v, uint8_t **rec, size_t *len, ts__rbuf **buf)
{
    assert_int_equal(ts__record_encode(v, rec, len), 0);
    assert_int_equal(*len, ts_value_encoded_size(v));
    assert_int_equal((*len - ts__get_u64le(*rec + 8)) % TS__ALIGN, 0); /* data_start */
    assert_int_equal(ts__record_validate(*rec, *len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    ts_value_t *d = decode_copy(*rec, *len, buf);
    assert_non_null(d);
    return d;
}

static void free_round_trip(ts_value_t *d, uint8_t *rec, size_t len, ts__rbuf *buf)
{
    ts_value_free(d);
    ts__rbuf_unref(buf);
    ts__free_aligned(rec, len);
}

/* The dtype table is part of the wire format: codes, sizes and names never change. */
static void test_dtype_table(void **state)
{
    (void)state;
    static const struct {
        int code;
        size_t size;
        const char *name;
    } table[] = {
        {1, 1, "bool"},    {2, 1, "uint8"},    {3, 1, "int8"},       {4, 2, "int16"},
        {5, 4, "int32"},   {6, 8, "int64"},    {7, 2, "float16"},    {8, 2, "bfloat16"},
        {9, 4, "float32"}, {10, 8, "float64"}, {11, 8, "complex64"}, {12, 16, "complex128"},
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(table); i++) {
        assert_int_equal(ts_dtype_size((ts_dtype_t)table[i].code), table[i].size);
        assert_string_equal(ts_dtype_name((ts_dtype_t)table[i].code), table[i].name);
        assert_int_equal(ts_dtype_from_name(table[i].name), table[i].code);
    }
    const int bad[] = {0, 13, 14, 100, 255, -1};
    for (size_t i = 0; i < TS__ARRAY_SIZE(bad); i++) {
        assert_int_equal(ts_dtype_size((ts_dtype_t)bad[i]), 0);
        assert_null(ts_dtype_name((ts_dtype_t)bad[i]));
    }
    assert_int_equal(ts_dtype_from_name("float"), TS_DTYPE_INVALID);
    assert_int_equal(ts_dtype_from_name(NULL), TS_DTYPE_INVALID);
    /* Every dtype code in a record: known ones validate, others are refused. */
    for (int code = 0; code < 256; code++) {
        mbuf m = {.n = 0};
        uint64_t dims[1] = {3};
        size_t esize = ts_dtype_size((ts_dtype_t)code);
        mb_tensor(&m, (uint8_t)code, 1, dims, 0, 3 * (esize ? esize : 1));
        assert_int_equal(check_meta(&m, 3 * 16), esize ? 0 : TS_EBADRECORD);
    }
}

/* The exact bytes of a small record: the example of docs/PROTOCOL.md. */
static void test_known_bytes(void **state)
{
    (void)state;
    static const uint8_t expect[136] = {
        0x54,         0x53, 0x52, 0x01, 0x34, 0x00, 0x00, 0x00, 0x08,
        0x00,         0x00, 0x00, 0x00, 0x00, 0x00, 0x00,             /* header */
        0x01,         0x02, 0x00, 0x00, 0x00,                         /* map, 2 entries */
        0x01,         0x00, 'w',                                      /* key "w" */
        0x03,         0x09, 0x01, 0x00, 0x00,                         /* tensor float32 ndim 1 */
        0x02,         0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,       /* dim 2 */
        0x00,         0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,       /* data_off 0 */
        0x08,         0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,       /* data_len 8 */
        0x04,         0x00, 's',  't',  'e',  'p',                    /* key "step" */
        0x04,         0x07, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, /* int 7 */
        [128] = 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0x40,       /* 1.0f, 2.0f */
    };
    float w[2] = {1.0f, 2.0f};
    int64_t shape[1] = {2};
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "w", ts_tensor_new(TS_FLOAT32, 1, shape, w, TS_BORROW)), 0);
    assert_int_equal(ts_map_set(m, "step", ts_int_new(7)), 0);
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(m, &rec, &len), 0);
    assert_int_equal(len, sizeof(expect));
    assert_memory_equal(rec, expect, sizeof(expect));
    ts__free_aligned(rec, len);
    ts_value_free(m);
}

static void test_zero_d_and_empty_tensors(void **state)
{
    (void)state;
    for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
        uint8_t scalar[16] = {0xAB, 0xCD};
        ts_value_t *l = ts_list_new();
        int64_t zero[1] = {0};
        int64_t hole[3] = {3, 0, 2};
        int64_t one[1] = {1};
        assert_int_equal(ts_list_push(l, ts_tensor_new((ts_dtype_t)dt, 0, NULL, scalar, 0)), 0);
        assert_int_equal(ts_list_push(l, ts_tensor_new((ts_dtype_t)dt, 1, zero, NULL, 0)), 0);
        assert_int_equal(ts_list_push(l, ts_tensor_new((ts_dtype_t)dt, 3, hole, NULL, 0)), 0);
        assert_int_equal(ts_list_push(l, ts_tensor_new((ts_dtype_t)dt, 1, one, scalar, 0)), 0);
        uint8_t *rec;
        size_t len;
        ts__rbuf *b;
        ts_value_t *d = round_trip(l, &rec, &len, &b);
        size_t esize = ts_dtype_size((ts_dtype_t)dt);
        const ts_tensor_t *t0 = ts_value_tensor(ts_list_at(d, 0));
        assert_int_equal(t0->ndim, 0);
        assert_int_equal(ts_tensor_numel(t0), 1);
        assert_int_equal(ts_tensor_nbytes(t0), esize);
        assert_memory_equal(t0->data, scalar, esize);
        const ts_tensor_t *t1 = ts_value_tensor(ts_list_at(d, 1));
        assert_int_equal(t1->ndim, 1);
        assert_int_equal(ts_tensor_numel(t1), 0);
        const ts_tensor_t *t2 = ts_value_tensor(ts_list_at(d, 2));
        assert_int_equal(t2->shape[0], 3);
        assert_int_equal(t2->shape[1], 0);
        assert_int_equal(ts_tensor_nbytes(t2), 0);
        const ts_tensor_t *t3 = ts_value_tensor(ts_list_at(d, 3));
        assert_memory_equal(t3->data, scalar, esize);
        assert_int_equal((uintptr_t)t3->data % TS__ALIGN, 0);
        free_round_trip(d, rec, len, b);
        ts_value_free(l);
    }

    /*
     * A zero dimension after a huge one: the running product stays below 2^64, so the record is
     * valid; counting its elements must not overflow a signed integer (UBSan watches).
     */
    mbuf m = {.n = 0};
    uint64_t dims[3] = {(uint64_t)1 << 62, 3, 0};
    mb_tensor(&m, TS_UINT8, 3, dims, 0, 0);
    size_t len;
    uint8_t *rec = mk_record(&m, 0, &len);
    ts__rbuf *b;
    ts_value_t *d = decode_copy(rec, len, &b);
    assert_non_null(d);
    assert_int_equal(ts_tensor_numel(ts_value_tensor(d)), 0);
    assert_int_equal(ts_tensor_nbytes(ts_value_tensor(d)), 0);
    ts_value_free(d);
    ts__rbuf_unref(b);
    ts__free_aligned(rec, len);
    /* The product is checked step by step: an overflow before the zero is refused. */
    uint64_t over[3] = {(uint64_t)1 << 62, 8, 0};
    m.n = 0;
    mb_tensor(&m, TS_UINT8, 3, over, 0, 0);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    uint64_t front[3] = {0, (uint64_t)1 << 62, 8};
    m.n = 0;
    mb_tensor(&m, TS_UINT8, 3, front, 0, 0);
    assert_int_equal(check_meta(&m, 0), 0);
    /* A dimension above INT64_MAX is refused even when another one is zero. */
    uint64_t neg[2] = {0, (uint64_t)INT64_MAX + 1};
    m.n = 0;
    mb_tensor(&m, TS_UINT8, 2, neg, 0, 0);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
}

static void test_scalar_roots_and_empty_containers(void **state)
{
    (void)state;
    double nan_bits_src;
    uint64_t nan_bits = 0x7ff8dead0000beefull;
    memcpy(&nan_bits_src, &nan_bits, sizeof(nan_bits));
    ts_value_t *roots[] = {
        ts_map_new(),
        ts_list_new(),
        ts_int_new(INT64_MIN),
        ts_int_new(-1),
        ts_float_new(-0.0),
        ts_float_new(nan_bits_src),
        ts_string_new("", 0),
        ts_bytes_new(NULL, 0, 0),
        ts_bytes_new("xyz", 3, TS_BORROW),
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(roots); i++) {
        assert_non_null(roots[i]);
        uint8_t *rec;
        size_t len;
        ts__rbuf *b;
        ts_value_t *d = round_trip(roots[i], &rec, &len, &b);
        assert_int_equal(ts_value_type(d), ts_value_type(roots[i]));
        /* Meta fits in 48 bytes, so the data area starts at 64 (only "xyz" has data). */
        assert_int_equal(len, 64 + (i == 8 ? 3 : 0));
        assert_int_equal(ts_value_len(d), 0);
        switch (ts_value_type(d)) {
        case TS_TYPE_INT: {
            int64_t a, e;
            assert_int_equal(ts_value_int(d, &a), 0);
            assert_int_equal(ts_value_int(roots[i], &e), 0);
            assert_true(a == e);
            break;
        }
        case TS_TYPE_FLOAT: {
            double a, e;
            assert_int_equal(ts_value_float(d, &a), 0);
            assert_int_equal(ts_value_float(roots[i], &e), 0);
            assert_memory_equal(&a, &e, sizeof(a)); /* bit-exact: -0.0 and NaN payloads */
            break;
        }
        case TS_TYPE_BYTES: {
            const void *p;
            size_t n;
            assert_int_equal(ts_value_bytes(d, &p, &n), 0);
            assert_int_equal(n, i == 8 ? 3 : 0);
            if (n > 0)
                assert_memory_equal(p, "xyz", 3);
            break;
        }
        default:
            break;
        }
        free_round_trip(d, rec, len, b);
        ts_value_free(roots[i]);
    }
}

static void test_strings_keys_and_bytes_at_limits(void **state)
{
    (void)state;
    /* Strings keep embedded NULs and their length; a large string is fine (u32 length). */
    size_t big = 1u << 20;
    char *s = ts__malloc(big);
    assert_non_null(s);
    for (size_t i = 0; i < big; i++)
        s[i] = (char)('a' + i % 26);
    s[10] = '\0';
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "big", ts_string_new(s, big)), 0);
    assert_int_equal(ts_map_set(m, "nul", ts_string_new("a\0b", 3)), 0);
    assert_int_equal(ts_map_set(m, "", ts_int_new(1)), 0); /* the empty key is a key */
    /* Keys up to 65535 bytes (u16 length on the wire); one more is refused. */
    char *key = ts__malloc(65537);
    assert_non_null(key);
    memset(key, 'k', 65536);
    key[65536] = '\0';
    assert_int_equal(ts_map_set(m, key, ts_int_new(2)), TS_EINVAL);
    key[65535] = '\0';
    assert_int_equal(ts_map_set(m, key, ts_int_new(3)), 0);
    /* Byte strings of several sizes, each 64-byte aligned in the data area. */
    uint8_t raw[200];
    for (size_t i = 0; i < sizeof(raw); i++)
        raw[i] = (uint8_t)i;
    ts_value_t *l = ts_list_new();
    const size_t sizes[] = {0, 1, 63, 64, 65, 200};
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++)
        assert_int_equal(ts_list_push(l, ts_bytes_new(raw, sizes[i], TS_COPY)), 0);
    assert_int_equal(ts_map_set(m, "bytes", l), 0);

    uint8_t *rec;
    size_t len;
    ts__rbuf *b;
    ts_value_t *d = round_trip(m, &rec, &len, &b);
    const char *str;
    size_t sl;
    assert_int_equal(ts_value_string(ts_map_get(d, "big"), &str, &sl), 0);
    assert_int_equal(sl, big);
    assert_memory_equal(str, s, big);
    assert_int_equal(str[big], '\0');
    assert_int_equal(ts_value_string(ts_map_get(d, "nul"), &str, &sl), 0);
    assert_int_equal(sl, 3);
    assert_memory_equal(str, "a\0b", 3);
    int64_t v;
    assert_int_equal(ts_map_get_int(d, "", &v), 0);
    assert_int_equal(v, 1);
    assert_int_equal(ts_map_get_int(d, key, &v), 0);
    assert_int_equal(v, 3);
    assert_int_equal(strlen(ts_map_key_at(d, 3)), 65535);
    const ts_value_t *bl = ts_map_get(d, "bytes");
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        const void *p;
        size_t n;
        assert_int_equal(ts_value_bytes(ts_list_at(bl, i), &p, &n), 0);
        assert_int_equal(n, sizes[i]);
        assert_int_equal((uintptr_t)p % TS__ALIGN, 0);
        if (n > 0)
            assert_memory_equal(p, raw, n);
    }
    free_round_trip(d, rec, len, b);
    ts_value_free(m);
    ts__free(key);
    ts__free(s);
}

/* Each structural rule of the validator, broken alone. */
static void test_validator_rules(void **state)
{
    (void)state;
    mbuf m = {.n = 0};
    uint64_t d4[1] = {4};
    /* A valid base: a list of two float32[4] tensors at 0 and 64. */
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 2);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 0, 16);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 64, 16);
    assert_int_equal(check_meta(&m, 80), 0);
    /* The data area may extend past the last range (receivers ignore the excess). */
    assert_int_equal(check_meta(&m, 1000), 0);
    /* A range past the data area. */
    assert_int_equal(check_meta(&m, 79), TS_EBADRECORD);

    /* Overlapping ranges (the same offset twice) and out-of-order ranges. */
    m.n = 0;
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 2);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 0, 16);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 0, 16);
    assert_int_equal(check_meta(&m, 80), TS_EBADRECORD);
    m.n = 0;
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 2);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 64, 16);
    mb_tensor(&m, TS_FLOAT32, 1, d4, 0, 16);
    assert_int_equal(check_meta(&m, 80), TS_EBADRECORD);
    /* Two empty ranges may share an offset; an empty range may sit at the very end. */
    uint64_t d0[1] = {0};
    m.n = 0;
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 3);
    mb_tensor(&m, TS_FLOAT32, 1, d0, 0, 0);
    mb_bytes(&m, 0, 0);
    mb_bytes(&m, 64, 0);
    assert_int_equal(check_meta(&m, 64), 0);
    /* Misaligned byte-string offset; offset + length overflowing 64 bits. */
    m.n = 0;
    mb_bytes(&m, 8, 1);
    assert_int_equal(check_meta(&m, 64), TS_EBADRECORD);
    m.n = 0;
    mb_bytes(&m, UINT64_MAX - 63, 128);
    assert_int_equal(check_meta(&m, 64), TS_EBADRECORD);
    m.n = 0;
    mb_tensor(&m, TS_UINT8, 1, (uint64_t[]){128}, UINT64_MAX - 63, 128);
    assert_int_equal(check_meta(&m, 64), TS_EBADRECORD);

    /* Unknown value types. */
    const uint8_t types[] = {0, 8, 9, 0x80, 0xff};
    for (size_t i = 0; i < TS__ARRAY_SIZE(types); i++) {
        m.n = 0;
        mb_u8(&m, types[i]);
        mb_u64(&m, 0);
        assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    }
    /* Meta must hold exactly one value: nothing missing, nothing after it. */
    m.n = 0;
    mb_u8(&m, TS_TYPE_INT);
    mb_u64(&m, 5);
    assert_int_equal(check_meta(&m, 0), 0);
    mb_u8(&m, 0);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    m.n = 0;
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD); /* empty meta */
    /* Counts beyond the remaining meta, truncated keys and strings. */
    m.n = 0;
    mb_u8(&m, TS_TYPE_MAP);
    mb_u32(&m, UINT32_MAX);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    m.n = 0;
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 2);
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 0);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    m.n = 0;
    mb_u8(&m, TS_TYPE_MAP);
    mb_u32(&m, 1);
    mb_u16(&m, 40); /* key longer than the rest of meta */
    mb_u8(&m, TS_TYPE_INT);
    mb_u64(&m, 0);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    m.n = 0;
    mb_u8(&m, TS_TYPE_STRING);
    mb_u32(&m, 5);
    mb_u8(&m, 'a');
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    m.n = 0;
    mb_u8(&m, TS_TYPE_STRING);
    mb_u32(&m, UINT32_MAX);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    /* A map with an empty key and a nested empty map and list is fine. */
    m.n = 0;
    mb_u8(&m, TS_TYPE_MAP);
    mb_u32(&m, 2);
    mb_key(&m, "");
    mb_u8(&m, TS_TYPE_MAP);
    mb_u32(&m, 0);
    mb_key(&m, "l");
    mb_u8(&m, TS_TYPE_LIST);
    mb_u32(&m, 0);
    assert_int_equal(check_meta(&m, 0), 0);

    /* Tensors: ndim up to 8, reserved bytes zero, length exactly shape x element size. */
    uint64_t ones[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    m.n = 0;
    mb_tensor(&m, TS_INT16, 8, ones, 0, 2);
    assert_int_equal(check_meta(&m, 2), 0);
    m.n = 0;
    mb_tensor(&m, TS_INT16, 9, ones, 0, 2);
    assert_int_equal(check_meta(&m, 2), TS_EBADRECORD);
    m.n = 0;
    mb_tensor(&m, TS_INT16, 1, ones, 0, 3);
    assert_int_equal(check_meta(&m, 3), TS_EBADRECORD);
    m.n = 0;
    mb_tensor(&m, TS_INT16, 1, ones, 0, 1);
    assert_int_equal(check_meta(&m, 2), TS_EBADRECORD);
    m.n = 0;
    mb_tensor(&m, TS_INT16, 1, ones, 0, 2);
    m.b[3] = 1; /* the reserved u16 */
    assert_int_equal(check_meta(&m, 2), TS_EBADRECORD);
    /* A truncated tensor descriptor. */
    m.n = 0;
    mb_tensor(&m, TS_INT16, 2, ones, 0, 2);
    m.n -= 9;
    assert_int_equal(check_meta(&m, 2), TS_EBADRECORD);
}

/* The record header: magic, lengths and padding. */
static void test_record_header_rules(void **state)
{
    (void)state;
    mbuf m = {.n = 0};
    mb_u8(&m, TS_TYPE_BYTES);
    mb_u64(&m, 0);
    mb_u64(&m, 5);
    size_t len;
    uint8_t *rec = mk_record(&m, 5, &len);
    assert_int_equal(len, 64 + 5);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    /* Magic, byte by byte. */
    for (int i = 0; i < 4; i++) {
        rec[i] ^= 0x20;
        assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                         TS_EBADRECORD);
        rec[i] ^= 0x20;
    }
    /* The record length must be exactly data_start + data_len: one byte less or more fails. */
    assert_int_equal(ts__record_validate(rec, len - 1, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    uint8_t *longer = ts__malloc_aligned(len + 1);
    assert_non_null(longer);
    memcpy(longer, rec, len);
    longer[len] = 0;
    assert_int_equal(ts__record_validate(longer, len + 1, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                     TS_EBADRECORD);
    ts__free_aligned(longer, len + 1);
    /* Every padding byte between meta and the data area must be zero. */
    for (size_t i = TS_REC_HDR_SIZE + m.n; i < 64; i++) {
        rec[i] = 1;
        assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                         TS_EBADRECORD);
        rec[i] = 0;
    }
    /* meta_len beyond the record, and a data_len that makes the total wrap. */
    ts__put_u32le(rec + 4, UINT32_MAX);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    ts__put_u32le(rec + 4, (uint32_t)m.n);
    ts__put_u64le(rec + 8, UINT64_MAX - 10);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    ts__put_u64le(rec + 8, 5);
    /* A meta_len that still fits the padding but adds a zero byte after the value. */
    ts__put_u32le(rec + 4, (uint32_t)m.n + 1);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), TS_EBADRECORD);
    ts__put_u32le(rec + 4, (uint32_t)m.n);
    assert_int_equal(ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    /* Shorter than a header. */
    for (size_t n = 0; n < TS_REC_HDR_SIZE; n++)
        assert_int_equal(ts__record_validate(rec, n, TS_MAX_DEPTH, TS_MAX_NDIM, NULL),
                         TS_EBADRECORD);
    ts__free_aligned(rec, len);
}

/* Nesting: 32 levels (the root is level 1) pass at the protocol limit, 33 do not. */
static void test_depth_at_protocol_limit(void **state)
{
    (void)state;
    mbuf m = {.n = 0};
    for (int i = 0; i < TS_MAX_DEPTH - 1; i++) {
        mb_u8(&m, TS_TYPE_LIST);
        mb_u32(&m, 1);
    }
    mb_u8(&m, TS_TYPE_INT);
    mb_u64(&m, 1);
    assert_int_equal(check_meta(&m, 0), 0);
    m.n = 0;
    for (int i = 0; i < TS_MAX_DEPTH; i++) {
        mb_u8(&m, TS_TYPE_MAP);
        mb_u32(&m, 1);
        mb_key(&m, "k");
    }
    mb_u8(&m, TS_TYPE_INT);
    mb_u64(&m, 1);
    assert_int_equal(check_meta(&m, 0), TS_EBADRECORD);
    /* The encoder agrees: 32 levels encode, 33 do not. */
    ts_value_t *root = ts_list_new();
    ts_value_t *cur = root;
    for (int i = 0; i < TS_MAX_DEPTH - 2; i++) {
        ts_value_t *l = ts_list_new();
        assert_int_equal(ts_list_push(cur, l), 0);
        cur = l;
    }
    assert_int_equal(ts_list_push(cur, ts_int_new(1)), 0);
    assert_true(ts_value_encoded_size(root) > 0);
    ts_value_t *deeper = ts_list_new();
    assert_int_equal(ts_list_push(deeper, root), 0);
    assert_int_equal(ts_value_encoded_size(deeper), 0);
    ts_value_free(deeper);
}

/* Decoding a record that sits inside a larger buffer, as items of a reply do. */
static void test_decode_at_offset(void **state)
{
    (void)state;
    int32_t data[3] = {7, 8, 9};
    int64_t shape[1] = {3};
    ts_value_t *t = ts_tensor_new(TS_INT32, 1, shape, data, TS_BORROW);
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(t, &rec, &len), 0);
    size_t blen = 128 + len + 64;
    uint8_t *buf = ts__malloc_aligned(blen);
    assert_non_null(buf);
    memset(buf, 0xEE, blen);
    memcpy(buf + 128, rec, len);
    ts__rbuf *b = ts__rbuf_new(buf, blen, NULL);
    assert_non_null(b);
    ts_value_t *d = ts__record_decode(b, 128, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    assert_non_null(d);
    const ts_tensor_t *dt = ts_value_tensor(d);
    assert_memory_equal(dt->data, data, sizeof(data));
    assert_ptr_equal(dt->data, buf + 128 + 64);
    /* The tree holds its own reference: dropping ours keeps the buffer alive. */
    ts__rbuf_ref(b);
    ts__rbuf_unref(b);
    /* Ranges outside the buffer, and a record that is not where it is said to be. */
    assert_null(ts__record_decode(b, blen + 1, 0, TS_MAX_DEPTH, TS_MAX_NDIM));
    assert_null(ts__record_decode(b, 128, blen, TS_MAX_DEPTH, TS_MAX_NDIM));
    assert_null(ts__record_decode(b, 128, SIZE_MAX, TS_MAX_DEPTH, TS_MAX_NDIM));
    assert_null(ts__record_decode(b, 64, len, TS_MAX_DEPTH, TS_MAX_NDIM));
    assert_null(ts__record_decode(b, 128, len, TS_MAX_DEPTH, 0)); /* ndim above the limit */
    ts__rbuf_unref(b);
    assert_memory_equal(dt->data, data, sizeof(data)); /* still alive through the tree */
    ts_value_free(d);
    ts__free_aligned(rec, len);
    ts_value_free(t);
}

/* The encoding plan: the segments a client writes with writev reproduce the record. */
static void test_plan_segments(void **state)
{
    (void)state;
    uint8_t a[100], c[3];
    memset(a, 0x11, sizeof(a));
    memset(c, 0x33, sizeof(c));
    int64_t sa[2] = {10, 10};
    int64_t s0[1] = {0};
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "a", ts_tensor_new(TS_UINT8, 2, sa, a, TS_BORROW)), 0);
    assert_int_equal(ts_map_set(m, "e", ts_tensor_new(TS_FLOAT32, 1, s0, NULL, TS_BORROW)), 0);
    assert_int_equal(ts_map_set(m, "c", ts_bytes_new(c, sizeof(c), TS_BORROW)), 0);
    ts__enc e;
    assert_int_equal(ts__record_plan(m, &e), 0);
    assert_int_equal(e.head_len % TS__ALIGN, 0);
    assert_int_equal(e.nsegs, 3);
    assert_ptr_equal(e.segs[0].ptr, a);
    assert_int_equal(e.segs[0].len, 100);
    assert_int_equal(e.segs[0].pad_after, 28); /* up to 128 */
    assert_int_equal(e.segs[1].len, 0);
    assert_int_equal(e.segs[1].pad_after, 0); /* the empty tensor sits at 128 */
    assert_ptr_equal(e.segs[2].ptr, c);
    assert_int_equal(e.segs[2].len, 3);
    assert_int_equal(e.segs[2].pad_after, 0); /* the record ends with the last range */
    assert_int_equal(e.total, e.head_len + 128 + 3);
    assert_int_equal(e.total, ts_value_encoded_size(m));
    uint8_t *copy = ts__malloc(e.total);
    assert_non_null(copy);
    ts__enc_copy(&e, copy);
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(m, &rec, &len), 0);
    assert_int_equal(len, e.total);
    assert_memory_equal(copy, rec, len);
    ts__free(copy);
    ts__free_aligned(rec, len);
    ts__enc_free(&e);
    assert_int_equal(ts__record_plan(NULL, &e), TS_EINVAL);
    ts_value_free(m);
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
        cmocka_unit_test(test_dtype_table),
        cmocka_unit_test(test_known_bytes),
        cmocka_unit_test(test_zero_d_and_empty_tensors),
        cmocka_unit_test(test_scalar_roots_and_empty_containers),
        cmocka_unit_test(test_strings_keys_and_bytes_at_limits),
        cmocka_unit_test(test_validator_rules),
        cmocka_unit_test(test_record_header_rules),
        cmocka_unit_test(test_depth_at_protocol_limit),
        cmocka_unit_test(test_decode_at_offset),
        cmocka_unit_test(test_plan_segments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
