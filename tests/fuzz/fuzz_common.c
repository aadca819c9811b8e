/* Properties of the record codec that every fuzz target checks on the records it meets. */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>

void ts__fz_fail(const char *file, int line, const char *what)
{
    fprintf(stderr, "%s:%d: property failed: %s\n", file, line, what);
    abort();
}

/* A sink for bytes read on purpose, so the reads stay and ASan checks them. */
static volatile uint8_t sink;

/* Read the first and the last byte of p[0..n), when there are any. */
static void touch(const void *p, size_t n)
{
    if (n == 0)
        return;
    sink = ((const uint8_t *)p)[0];
    sink = ((const uint8_t *)p)[n - 1];
}

/* Check that [p, p+n) lies inside [lo, hi) and starts 64-byte aligned relative to lo. */
static void in_range(const void *p, size_t n, const uint8_t *lo, const uint8_t *hi)
{
    const uint8_t *b = p;
    FZ_CHECK(b >= lo && b <= hi);
    FZ_CHECK(n <= (size_t)(hi - b));
    FZ_CHECK((size_t)(b - lo) % TS__ALIGN == 0);
    touch(p, n);
}

/*
 * Walk a decoded tree through the public reading functions. [lo, hi) is the record's data area.
 * Returns the number of values seen.
 */
static size_t walk(const ts_value_t *v, const uint8_t *lo, const uint8_t *hi, int depth)
{
    FZ_CHECK(v != NULL);
    FZ_CHECK(depth <= TS_MAX_DEPTH);
    size_t nodes = 1;
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
        for (size_t i = 0; i < ts_value_len(v); i++) {
            const char *key = ts_map_key_at(v, i);
            FZ_CHECK(key != NULL);
            /* A lookup by key finds this entry or an earlier one with the same key. */
            FZ_CHECK(ts_map_get(v, key) != NULL);
            nodes += walk(ts_map_value_at(v, i), lo, hi, depth + 1);
        }
        FZ_CHECK(ts_map_key_at(v, ts_value_len(v)) == NULL);
        break;
    case TS_TYPE_LIST:
        for (size_t i = 0; i < ts_value_len(v); i++)
            nodes += walk(ts_list_at(v, i), lo, hi, depth + 1);
        FZ_CHECK(ts_list_at(v, ts_value_len(v)) == NULL);
        break;
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        FZ_CHECK(t != NULL);
        FZ_CHECK(ts_dtype_size(t->dtype) > 0);
        FZ_CHECK(t->ndim >= 0 && t->ndim <= TS_MAX_NDIM);
        int zero = 0;
        for (int i = 0; i < t->ndim; i++) {
            FZ_CHECK(t->shape[i] >= 0);
            zero |= t->shape[i] == 0;
        }
        size_t nbytes = ts_tensor_nbytes(t);
        int64_t numel = ts_tensor_numel(t);
        FZ_CHECK(numel >= 0);
        FZ_CHECK(zero ? nbytes == 0 && numel == 0
                      : nbytes == (size_t)numel * ts_dtype_size(t->dtype));
        in_range(t->data, nbytes, lo, hi);
        break;
    }
    case TS_TYPE_INT: {
        int64_t i;
        double f;
        FZ_CHECK(ts_value_int(v, &i) == 0);
        FZ_CHECK(ts_value_float(v, &f) == 0);
        break;
    }
    case TS_TYPE_FLOAT: {
        double f;
        int64_t i;
        FZ_CHECK(ts_value_float(v, &f) == 0);
        FZ_CHECK(ts_value_int(v, &i) == TS_ETYPE);
        break;
    }
    case TS_TYPE_STRING: {
        const char *s;
        size_t n;
        FZ_CHECK(ts_value_string(v, &s, &n) == 0);
        touch(s, n);
        FZ_CHECK(s[n] == '\0');
        break;
    }
    case TS_TYPE_BYTES: {
        const void *p;
        size_t n;
        FZ_CHECK(ts_value_bytes(v, &p, &n) == 0);
        in_range(p, n, lo, hi);
        break;
    }
    default:
        FZ_CHECK(!"a decoded value has an unknown type");
    }
    return nodes;
}

/* 1 when two trees hold the same values (map keys compared as C strings). */
static int same(const ts_value_t *a, const ts_value_t *b)
{
    if (ts_value_type(a) != ts_value_type(b))
        return 0;
    switch (ts_value_type(a)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int is_map = ts_value_type(a) == TS_TYPE_MAP;
        if (ts_value_len(a) != ts_value_len(b))
            return 0;
        for (size_t i = 0; i < ts_value_len(a); i++) {
            if (is_map && strcmp(ts_map_key_at(a, i), ts_map_key_at(b, i)) != 0)
                return 0;
            if (!same(is_map ? ts_map_value_at(a, i) : ts_list_at(a, i),
                      is_map ? ts_map_value_at(b, i) : ts_list_at(b, i)))
                return 0;
        }
        return 1;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *x = ts_value_tensor(a), *y = ts_value_tensor(b);
        if (x->dtype != y->dtype || x->ndim != y->ndim)
            return 0;
        for (int i = 0; i < x->ndim; i++)
            if (x->shape[i] != y->shape[i])
                return 0;
        size_t n = ts_tensor_nbytes(x);
        return n == 0 || memcmp(x->data, y->data, n) == 0;
    }
    case TS_TYPE_INT: {
        int64_t x, y;
        ts_value_int(a, &x);
        ts_value_int(b, &y);
        return x == y;
    }
    case TS_TYPE_FLOAT: {
        double x, y;
        ts_value_float(a, &x);
        ts_value_float(b, &y);
        return memcmp(&x, &y, sizeof(x)) == 0; /* bit patterns, NaN payloads included */
    }
    case TS_TYPE_STRING: {
        const char *x, *y;
        size_t nx, ny;
        ts_value_string(a, &x, &nx);
        ts_value_string(b, &y, &ny);
        return nx == ny && memcmp(x, y, nx) == 0;
    }
    case TS_TYPE_BYTES: {
        const void *x, *y;
        size_t nx, ny;
        ts_value_bytes(a, &x, &nx);
        ts_value_bytes(b, &y, &ny);
        return nx == ny && (nx == 0 || memcmp(x, y, nx) == 0);
    }
    default:
        return 0;
    }
}

/* Re-encode a decoded tree; the result must validate and decode to the same values. */
static void re_encode(const ts_value_t *root)
{
    uint8_t *out;
    size_t olen;
    FZ_CHECK(ts__record_encode(root, &out, &olen) == 0);
    FZ_CHECK(olen == ts_value_encoded_size(root));
    FZ_CHECK(ts__record_validate(out, olen, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) == 0);
    ts__rbuf *b = ts__rbuf_new(out, olen, NULL);
    FZ_CHECK(b != NULL);
    ts_value_t *again = ts__record_decode(b, 0, olen, TS_MAX_DEPTH, TS_MAX_NDIM);
    FZ_CHECK(again != NULL);
    FZ_CHECK(same(root, again));
    ts_value_free(again);
    ts__rbuf_unref(b);
}

int ts__fz_check_record_in(ts__rbuf *buf, size_t off, size_t len)
{
    const uint8_t *rec = buf->data + off;
    ts__rec_info info;
    int rc = ts__record_validate(rec, len, TS_MAX_DEPTH, TS_MAX_NDIM, &info);
    FZ_CHECK(rc == 0 || rc == TS_EBADRECORD);

    /* Tighter limits never accept more than the protocol's own. */
    int depth = 1 + (int)(len % TS_MAX_DEPTH);
    int ndim = (int)(len % (TS_MAX_NDIM + 1));
    if (ts__record_validate(rec, len, depth, ndim, NULL) == 0)
        FZ_CHECK(rc == 0);

    ts_value_t *root = ts__record_decode(buf, off, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    FZ_CHECK((root != NULL) == (rc == 0));
    if (root == NULL)
        return TS_EBADRECORD;
    FZ_CHECK(info.data_start % TS__ALIGN == 0 && info.data_start <= len);
    size_t nodes = walk(root, rec + info.data_start, rec + len, 1);
    FZ_CHECK(nodes == info.n_nodes);
    re_encode(root);

    /* Decoding makes one allocation: failing it gives NULL and leaks nothing. */
    ts__alloc_fail_after(1);
    ts_value_t *none = ts__record_decode(buf, off, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__alloc_fail_after(-1);
    FZ_CHECK(none == NULL);

    ts_value_free(root);
    return 0;
}

int ts__fz_check_record(const uint8_t *rec, size_t len)
{
    /* Records arrive in 64-byte aligned receive buffers; give the decoder the same. */
    uint8_t *copy = ts__malloc_aligned(len);
    FZ_CHECK(copy != NULL);
    if (len > 0)
        memcpy(copy, rec, len);
    ts__rbuf *b = ts__rbuf_new(copy, len, NULL);
    FZ_CHECK(b != NULL);
    int rc = ts__fz_check_record_in(b, 0, len);
    ts__rbuf_unref(b);
    return rc;
}
