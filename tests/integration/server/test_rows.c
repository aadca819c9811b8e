/*
 * Tensor bins and row access over raw sockets (docs/PROTOCOL.md 8.19 to 8.22): TENSOR_BIN and
 * its refusals, READ_ROWS, GATHER_ROWS and WRITE_ROWS on tensor bins and plain items over TCP
 * and the unix socket, every bad input answered without closing (or closing where the document
 * says), the tensor bin's refusal of PUT, APPEND and GET, notifications (event 5) and WAIT,
 * concurrent writers into disjoint rows, the memory limit on replies, and SAVE of a tensor bin.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "msg.h"
#include "record.h"
#include "test_server_util.h"

#define ROWS 100 /* rows of the tensor bins the tests make */
#define COLS 4   /* float32 columns per row */

static tsh_server srv;
static uint32_t rid = 1;

static int start(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/*
 * For the tests that start their own tensord: stop it when the test failed before it could
 * (by PID; one that was stopped already is left alone).
 */
static int stop_if_running(void **state)
{
    (void)state;
    if (srv.pid > 0)
        (void)tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return 0;
}

/* Send TENSOR_BIN through the codec. */
static void send_tensor_bin(int fd, uint32_t id, const char *name, uint8_t dtype, uint8_t ndim,
                            const uint64_t *dims)
{
    ts__msg_tensor_bin_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .dtype = dtype, .ndim = ndim};
    memcpy(m.dims, dims, 8 * (size_t)ndim);
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_tensor_bin_req_encode(body, sizeof(body), &m, &len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_TENSOR_BIN, id, body, len), 0);
}

/* Make a float32 [ROWS, COLS] tensor bin; returns its version. */
static uint64_t make_bin(int fd, const char *name)
{
    uint64_t dims[2] = {ROWS, COLS};
    uint32_t id = rid++;
    send_tensor_bin(fd, id, name, TS_FLOAT32, 2, dims);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, id, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    return v;
}

static void send_read_rows(int fd, uint32_t id, const char *name, int32_t item, const char *key,
                           uint64_t start, uint64_t end)
{
    ts__msg_read_rows_req m = {.name = (const uint8_t *)name,
                               .name_len = strlen(name),
                               .item = item,
                               .key = (const uint8_t *)key,
                               .key_len = key != NULL ? strlen(key) : 0,
                               .start = start,
                               .end = end};
    uint8_t body[2048];
    size_t len;
    assert_int_equal(ts__msg_read_rows_req_encode(body, sizeof(body), &m, &len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_READ_ROWS, id, body, len), 0);
}

/* Send root (freed here) as the record of an upload request (GATHER_ROWS, WRITE_ROWS, PUT). */
static void send_record(int fd, uint8_t op, uint32_t id, const char *name, ts_value_t *root)
{
    uint8_t *rec;
    size_t len;
    assert_int_equal(ts__record_encode(root, &rec, &len), 0);
    ts_value_free(root);
    assert_int_equal(tsu_send_store(fd, op, id, name, rec, len), 0);
    ts__free_aligned(rec, len);
}

/* {"start": start, "rows": float32 [k, COLS] with row i holding base + i in every column}. */
static ts_value_t *write_args(int64_t start, int64_t k, float base)
{
    ts_value_t *m = ts_map_new();
    int64_t shape[2] = {k, COLS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(t);
    float *d = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < k; i++)
        for (int j = 0; j < COLS; j++)
            d[i * COLS + j] = base + (float)i;
    assert_int_equal(ts_map_set(m, "start", ts_int_new(start)), 0);
    assert_int_equal(ts_map_set(m, "rows", t), 0);
    return m;
}

static ts_value_t *gather_args(int64_t item, const char *key, const int64_t *ix, int64_t n)
{
    ts_value_t *m = ts_map_new();
    if (item != 0)
        assert_int_equal(ts_map_set(m, "item", ts_int_new(item)), 0);
    if (key != NULL)
        assert_int_equal(ts_map_set(m, "key", ts_string_new(key, strlen(key))), 0);
    assert_int_equal(ts_map_set(m, "index", ts_tensor_new(TS_INT64, 1, &n, ix, TS_COPY)), 0);
    return m;
}

/* Write k rows at start (values base + i) and return the version of the change. */
static uint64_t write_rows(int fd, const char *name, int64_t start, int64_t k, float base)
{
    uint32_t id = rid++;
    send_record(fd, TS_OP_WRITE_ROWS, id, name, write_args(start, k, base));
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_WRITE_ROWS, id, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    return v;
}

/* A rows reply: one record whose root is a tensor; copied out as floats (at most cap). */
typedef struct rows_reply {
    uint64_t version;
    uint32_t remaining;
    int ndim;
    int64_t shape[TS_MAX_NDIM];
    ts_dtype_t dtype;
    float v[ROWS * COLS * 4];
    size_t nv;
} rows_reply;

static void parse_rows(const tsu_frame *f, rows_reply *out)
{
    ts__msg_items m;
    assert_int_equal(ts__msg_items_decode(f->body, f->len, &m), 0);
    assert_int_equal(m.n_items, 1);
    ts__msg_items_iter it;
    size_t off, len;
    ts__msg_items_iter_init(&m, &it);
    assert_true(ts__msg_items_next(&m, &it, &off, &len));
    uint8_t *copy = ts__malloc_aligned(len);
    assert_non_null(copy);
    memcpy(copy, f->body + off, len);
    ts__rbuf *rb = ts__rbuf_new(copy, len, NULL);
    ts_value_t *root = ts__record_decode(rb, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    assert_non_null(root);
    const ts_tensor_t *t = ts_value_tensor(root);
    assert_non_null(t);
    out->version = m.version;
    out->remaining = m.remaining;
    out->ndim = t->ndim;
    out->dtype = t->dtype;
    memcpy(out->shape, t->shape, sizeof(out->shape));
    out->nv = 0;
    if (t->dtype == TS_FLOAT32) {
        out->nv = ts_tensor_nbytes(t) / 4;
        assert_true(out->nv <= TS__ARRAY_SIZE(out->v));
        memcpy(out->v, t->data, out->nv * 4);
    }
    ts__record_tree_free(root);
}

static void read_rows(int fd, const char *name, int32_t item, const char *key, uint64_t start,
                      uint64_t end, rows_reply *out)
{
    uint32_t id = rid++;
    send_read_rows(fd, id, name, item, key, start, end);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_READ_ROWS, id, TS_ST_OK);
    parse_rows(&f, out);
    tsu_frame_free(&f);
}

/* Expect an error reply with status for id, then check the connection still answers PING. */
static void expect_err_open(int fd, uint8_t op, uint32_t id, uint16_t status)
{
    tsu_frame f;
    tsu_expect(fd, &f, op, id, status);
    tsu_frame_free(&f);
    uint32_t p = rid++;
    assert_int_equal(tsh_send(fd, TS_OP_PING, p, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, p, TS_ST_OK);
    tsu_frame_free(&f);
}

static void check_rw(int fd)
{
    make_bin(fd, "emb");
    rows_reply r;
    read_rows(fd, "emb", 0, NULL, 0, ROWS, &r);
    assert_int_equal(r.ndim, 2);
    assert_int_equal(r.shape[0], ROWS);
    assert_int_equal(r.shape[1], COLS);
    for (size_t i = 0; i < r.nv; i++)
        assert_true(r.v[i] == 0.0f);
    uint64_t v = write_rows(fd, "emb", 10, 5, 100.0f);
    read_rows(fd, "emb", -1, NULL, 9, 16, &r);
    assert_true(r.version == v);
    assert_int_equal(r.remaining, 1);
    assert_int_equal(r.shape[0], 7);
    assert_true(r.v[0] == 0.0f);
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < COLS; j++)
            assert_true(r.v[(1 + i) * COLS + j] == 100.0f + (float)i);
    assert_true(r.v[6 * COLS] == 0.0f);
    /* Gather: repeated and unordered indexes. */
    int64_t ix[4] = {14, 10, 10, 99};
    uint32_t id = rid++;
    send_record(fd, TS_OP_GATHER_ROWS, id, "emb", gather_args(0, NULL, ix, 4));
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_GATHER_ROWS, id, TS_ST_OK);
    parse_rows(&f, &r);
    tsu_frame_free(&f);
    assert_int_equal(r.shape[0], 4);
    assert_int_equal(r.shape[1], COLS);
    assert_true(r.v[0] == 104.0f && r.v[COLS] == 100.0f && r.v[2 * COLS] == 100.0f);
    assert_true(r.v[3 * COLS] == 0.0f);
    /* An empty range and an empty index give a tensor of 0 rows. */
    read_rows(fd, "emb", 0, NULL, 7, 7, &r);
    assert_int_equal(r.shape[0], 0);
    /* PEEK shows the whole tensor as the root of the bin's one record. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "emb", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.remaining, 1);
    assert_int_equal(
        ts__record_validate(it.item[0], it.item_len[0], TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    tsu_frame_free(&it.f);
}

static void test_rows_tcp(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    check_rw(fd);
    assert_true(tsu_stat(fd, "ops_tensor_bin") == 1);
    assert_true(tsu_stat(fd, "ops_write_rows") == 1);
    assert_true(tsu_stat(fd, "ops_gather_rows") == 1);
    assert_true(tsu_stat(fd, "ops_read_rows") == 3);
    close(fd);
}

static void test_rows_unix(void **state)
{
    (void)state;
    int fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    check_rw(fd);
    close(fd);
}

static void test_tensor_bin_refusals(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    make_bin(fd, "t");
    uint64_t dims[8] = {4, 4, 4, 4, 4, 4, 4, 4};
    uint32_t id = rid++;
    send_tensor_bin(fd, id, "t", TS_FLOAT32, 2, dims); /* exists */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    id = rid++;
    send_tensor_bin(fd, id, "u", TS_FLOAT32, 0, dims); /* a scalar has no rows */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    id = rid++;
    send_tensor_bin(fd, id, "u", 0, 1, dims); /* dtype 0 */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    id = rid++;
    send_tensor_bin(fd, id, "u", 13, 1, dims); /* unknown dtype */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    uint64_t big[2] = {(uint64_t)1 << 63, 1};
    id = rid++;
    send_tensor_bin(fd, id, "u", TS_UINT8, 2, big); /* a dim over 2^63 - 1 */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    uint64_t wide[2] = {(uint64_t)1 << 40, (uint64_t)1 << 40};
    id = rid++;
    send_tensor_bin(fd, id, "u", TS_FLOAT64, 2, wide); /* more than 2^64 bytes */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    /* 2^64 - 2 bytes of data fit 64 bits, but not with the record's head: the message says so. */
    uint64_t edge[2] = {(uint64_t)INT64_MAX, 2};
    id = rid++;
    send_tensor_bin(fd, id, "u", TS_UINT8, 2, edge);
    tsu_frame ef;
    tsu_expect(fd, &ef, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    assert_non_null(memmem(ef.body, ef.len, "its 64-byte head and the tensor's data", 38));
    tsu_frame_free(&ef);
    uint64_t huge[1] = {(uint64_t)1 << 50};
    id = rid++;
    send_tensor_bin(fd, id, "u", TS_UINT8, 1, huge); /* 1 PiB: past the memory limit */
    expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_OUT_OF_MEMORY);
    /* ndim 9 and ndim 200, with all their dims in the body: INVALID, the connection stays. */
    for (unsigned nd = 9; nd <= 200; nd += 191) {
        uint8_t body[1 + 1 + 4 + 8 * 200];
        memset(body, 0, sizeof(body));
        body[0] = 1;
        body[1] = 'u';
        body[2] = TS_UINT8;
        body[3] = (uint8_t)nd;
        for (unsigned i = 0; i < nd; i++)
            ts__put_u64le(body + 6 + 8 * i, 1);
        id = rid++;
        assert_int_equal(tsh_send(fd, TS_OP_TENSOR_BIN, id, body, 6 + 8 * (size_t)nd), 0);
        expect_err_open(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    }
    /* The bin was never made by any of them. */
    id = rid++;
    send_read_rows(fd, id, "u", 0, NULL, 0, 0);
    expect_err_open(fd, TS_OP_READ_ROWS, id, TS_ST_NOT_FOUND);
    close(fd);
    /* A reserved field that is not 0: malformed, the connection closes. */
    fd = tsu_client(&srv);
    uint8_t bad[1 + 1 + 4 + 8] = {1, 'v', TS_UINT8, 1, 1, 0, 1};
    assert_int_equal(tsh_send(fd, TS_OP_TENSOR_BIN, 5, bad, sizeof(bad)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* The dims must fill the body exactly. */
    fd = tsu_client(&srv);
    assert_int_equal(tsh_send(fd, TS_OP_TENSOR_BIN, 6, bad, sizeof(bad) - 1), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    tsu_check_healthy(&srv);
}

static void test_tensor_bin_refuses_put_get(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    make_bin(fd, "t");
    size_t len;
    uint8_t *rec = tsu_rec_int(7, &len);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, id, "t", rec, len), 0);
    expect_err_open(fd, TS_OP_PUT, id, TS_ST_INVALID);
    id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, id, "t", rec, len), 0);
    expect_err_open(fd, TS_OP_APPEND, id, TS_ST_INVALID);
    id = rid++;
    assert_int_equal(tsu_send_get(fd, TS_OP_GET, id, "t", 0), 0);
    expect_err_open(fd, TS_OP_GET, id, TS_ST_INVALID);
    /* Still there, still one item; DELETE works and frees the name for a plain bin. */
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "t", 0, &it);
    assert_int_equal(it.n, 1);
    tsu_frame_free(&it.f);
    id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, id, "t", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_DELETE, id, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_put_int(fd, TS_OP_PUT, "t", 7, NULL);
    /* WRITE_ROWS on a plain bin: INVALID. */
    id = rid++;
    send_record(fd, TS_OP_WRITE_ROWS, id, "t", write_args(0, 1, 1.0f));
    expect_err_open(fd, TS_OP_WRITE_ROWS, id, TS_ST_INVALID);
    tsu_rec_free(rec, len);
    assert_true(tsu_stat(fd, "orphaned_bytes") == 0);
    assert_true(tsu_stat(fd, "bytes_reserved") == 0);
    close(fd);
}

/* One bad request after another on one connection: each INVALID or NOT_FOUND, none closes. */
static void test_rows_bad_inputs(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    make_bin(fd, "t");
    uint32_t id;
#define BAD_READ(item, key, s, e, st)                                                              \
    do {                                                                                           \
        id = rid++;                                                                                \
        send_read_rows(fd, id, "t", item, key, s, e);                                              \
        expect_err_open(fd, TS_OP_READ_ROWS, id, st);                                              \
    } while (0)
    BAD_READ(0, NULL, 0, ROWS + 1, TS_ST_INVALID);
    BAD_READ(0, NULL, 5, 4, TS_ST_INVALID);
    BAD_READ(0, NULL, UINT64_MAX, UINT64_MAX, TS_ST_INVALID);
    BAD_READ(1, NULL, 0, 1, TS_ST_INVALID);
    BAD_READ(-2, NULL, 0, 1, TS_ST_INVALID);
    BAD_READ(INT32_MIN, NULL, 0, 1, TS_ST_INVALID);
    BAD_READ(0, "w", 0, 1, TS_ST_INVALID); /* a key, but the root is a tensor */
    id = rid++;
    send_read_rows(fd, id, "nope", 0, NULL, 0, 1);
    expect_err_open(fd, TS_OP_READ_ROWS, id, TS_ST_NOT_FOUND);

#define BAD_UP(op, args, st)                                                                       \
    do {                                                                                           \
        id = rid++;                                                                                \
        send_record(fd, op, id, "t", args);                                                        \
        expect_err_open(fd, op, id, st);                                                           \
    } while (0)
    BAD_UP(TS_OP_WRITE_ROWS, write_args(ROWS - 1, 2, 1.0f), TS_ST_INVALID);
    BAD_UP(TS_OP_WRITE_ROWS, write_args(-1, 1, 1.0f), TS_ST_INVALID);
    BAD_UP(TS_OP_WRITE_ROWS, write_args(INT64_MAX, 1, 1.0f), TS_ST_INVALID);
    /* Wrong dtype, wrong trailing shape, wrong ndim. */
    int64_t sh[3] = {2, COLS, 1};
    ts_value_t *m = ts_map_new();
    ts_map_set(m, "start", ts_int_new(0));
    ts_map_set(m, "rows", ts_tensor_alloc(TS_FLOAT64, 2, sh));
    BAD_UP(TS_OP_WRITE_ROWS, m, TS_ST_INVALID);
    int64_t sh2[2] = {2, COLS + 1};
    m = ts_map_new();
    ts_map_set(m, "start", ts_int_new(0));
    ts_map_set(m, "rows", ts_tensor_alloc(TS_FLOAT32, 2, sh2));
    BAD_UP(TS_OP_WRITE_ROWS, m, TS_ST_INVALID);
    m = ts_map_new();
    ts_map_set(m, "start", ts_int_new(0));
    ts_map_set(m, "rows", ts_tensor_alloc(TS_FLOAT32, 3, sh));
    BAD_UP(TS_OP_WRITE_ROWS, m, TS_ST_INVALID);
    /* Missing and unknown keys, a root that is not a map. */
    m = ts_map_new();
    ts_map_set(m, "rows", ts_tensor_alloc(TS_FLOAT32, 2, sh));
    BAD_UP(TS_OP_WRITE_ROWS, m, TS_ST_INVALID);
    m = write_args(0, 1, 1.0f);
    ts_map_set(m, "stride", ts_int_new(2));
    BAD_UP(TS_OP_WRITE_ROWS, m, TS_ST_INVALID);
    BAD_UP(TS_OP_WRITE_ROWS, ts_int_new(3), TS_ST_INVALID);
    /* Gather: an index of the wrong dtype, of 2 dimensions, out of range, negative. */
    int32_t i32[2] = {0, 1};
    int64_t two = 2;
    m = ts_map_new();
    ts_map_set(m, "index", ts_tensor_new(TS_INT32, 1, &two, i32, TS_COPY));
    BAD_UP(TS_OP_GATHER_ROWS, m, TS_ST_INVALID);
    int64_t i2[2] = {0, 1}, sh11[2] = {1, 2};
    m = ts_map_new();
    ts_map_set(m, "index", ts_tensor_new(TS_INT64, 2, sh11, i2, TS_COPY));
    BAD_UP(TS_OP_GATHER_ROWS, m, TS_ST_INVALID);
    int64_t oor[3] = {0, ROWS, 1};
    BAD_UP(TS_OP_GATHER_ROWS, gather_args(0, NULL, oor, 3), TS_ST_INVALID);
    int64_t neg[1] = {-1};
    BAD_UP(TS_OP_GATHER_ROWS, gather_args(0, NULL, neg, 1), TS_ST_INVALID);
    BAD_UP(TS_OP_GATHER_ROWS, gather_args(3, NULL, i2, 1), TS_ST_INVALID);
    BAD_UP(TS_OP_GATHER_ROWS, gather_args(0, "w", i2, 1), TS_ST_INVALID);
    m = ts_map_new();
    ts_map_set(m, "item", ts_int_new(0));
    BAD_UP(TS_OP_GATHER_ROWS, m, TS_ST_INVALID);
    m = gather_args(0, NULL, i2, 1);
    ts_map_set(m, "item", ts_string_new("0", 1));
    BAD_UP(TS_OP_GATHER_ROWS, m, TS_ST_INVALID);
    /* A bin that does not exist. */
    id = rid++;
    send_record(fd, TS_OP_GATHER_ROWS, id, "nope", gather_args(0, NULL, i2, 1));
    expect_err_open(fd, TS_OP_GATHER_ROWS, id, TS_ST_NOT_FOUND);
#undef BAD_READ
#undef BAD_UP
    /* Nothing held on to: no reservation, no reply copy, and the tensor unchanged. */
    assert_true(tsu_stat(fd, "bytes_reserved") == 0);
    assert_true(tsu_stat(fd, "orphaned_bytes") == 0);
    rows_reply r;
    read_rows(fd, "t", 0, NULL, 0, ROWS, &r);
    for (size_t i = 0; i < r.nv; i++)
        assert_true(r.v[i] == 0.0f);
    close(fd);
}

/* Malformed bodies close the connection; a bad record is BAD_RECORD. */
static void test_rows_malformed(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint8_t body[64] = {1, 't', 0, 0, 0, 0, 0, 0};
    /* READ_ROWS cut short. */
    assert_int_equal(tsh_send(fd, TS_OP_READ_ROWS, 1, body, 10), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A key_len the body does not hold. */
    fd = tsu_client(&srv);
    memset(body, 0, sizeof(body));
    body[0] = 1;
    body[1] = 't';
    ts__put_u16le(body + 6, 40);
    assert_int_equal(tsh_send(fd, TS_OP_READ_ROWS, 2, body, 2 + 22), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A key over 1024 bytes. */
    fd = tsu_client(&srv);
    static uint8_t longkey[2 + 6 + 1100 + 16];
    memset(longkey, 'k', sizeof(longkey));
    longkey[0] = 1;
    longkey[1] = 't';
    ts__put_u32le(longkey + 2, 0);
    ts__put_u16le(longkey + 6, 1100);
    assert_int_equal(tsh_send(fd, TS_OP_READ_ROWS, 3, longkey, sizeof(longkey)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A WRITE_ROWS whose record is broken. */
    fd = tsu_client(&srv);
    uint8_t junk[32];
    memset(junk, 0xAB, sizeof(junk));
    assert_int_equal(tsu_send_store(fd, TS_OP_WRITE_ROWS, 4, "t", junk, sizeof(junk)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_RECORD);
    close(fd);
    tsu_check_healthy(&srv);
}

/* Rows of a plain bin's items: the root tensor, or an entry of the root map. */
static void test_rows_plain_items(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    for (int k = 0; k < 2; k++) {
        ts_value_t *m = ts_map_new();
        int64_t shape[2] = {3, 2};
        ts_value_t *w = ts_tensor_alloc(TS_FLOAT32, 2, shape);
        float *d = ts_value_tensor(w)->data;
        for (int i = 0; i < 6; i++)
            d[i] = (float)(10 * k + i);
        ts_map_set(m, "w", w);
        ts_map_set(m, "step", ts_int_new(k));
        uint8_t *rec;
        size_t len;
        assert_int_equal(ts__record_encode(m, &rec, &len), 0);
        ts_value_free(m);
        tsu_store(fd, TS_OP_APPEND, "p", rec, len, NULL);
        ts__free_aligned(rec, len);
    }
    rows_reply r;
    read_rows(fd, "p", -1, "w", 1, 3, &r);
    assert_int_equal(r.shape[0], 2);
    assert_int_equal(r.shape[1], 2);
    assert_true(r.v[0] == 12.0f && r.v[3] == 15.0f);
    assert_int_equal(r.remaining, 2);
    int64_t ix[2] = {2, 0};
    uint32_t id = rid++;
    send_record(fd, TS_OP_GATHER_ROWS, id, "p", gather_args(0, "w", ix, 2));
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_GATHER_ROWS, id, TS_ST_OK);
    parse_rows(&f, &r);
    tsu_frame_free(&f);
    assert_true(r.v[0] == 4.0f && r.v[1] == 5.0f && r.v[2] == 0.0f);
    id = rid++;
    send_read_rows(fd, id, "p", 0, "x", 0, 1); /* no such key */
    expect_err_open(fd, TS_OP_READ_ROWS, id, TS_ST_NOT_FOUND);
    id = rid++;
    send_read_rows(fd, id, "p", 0, "step", 0, 1); /* not a tensor */
    expect_err_open(fd, TS_OP_READ_ROWS, id, TS_ST_INVALID);
    id = rid++;
    send_read_rows(fd, id, "p", 0, NULL, 0, 1); /* the root is a map */
    expect_err_open(fd, TS_OP_READ_ROWS, id, TS_ST_INVALID);
    close(fd);
}

/* A listener sees one event 5 per write, creation as event 1; WAIT is answered by a write. */
static void test_rows_notify_and_wait(void **state)
{
    (void)state;
    int w = tsu_client(&srv), l = tsu_client(&srv), q = tsu_client(&srv);
    assert_int_equal(tsu_send_name(l, TS_OP_LISTEN, 1, "t", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(l, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    uint64_t v0 = make_bin(w, "t");
    tsu_note n;
    assert_int_equal(tsu_recv(l, &f), 0);
    tsu_note_parse(&f, &n);
    tsu_frame_free(&f);
    assert_int_equal(n.event, TS_NOTE_PUT);
    assert_true(n.version == v0);
    assert_int_equal(tsu_send_wait(q, 2, "t", v0, 10000), 0);
    uint64_t vs[5];
    for (int i = 0; i < 5; i++)
        vs[i] = write_rows(w, "t", i, 1, (float)i);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(tsu_recv(l, &f), 0);
        tsu_note_parse(&f, &n);
        tsu_frame_free(&f);
        assert_int_equal(n.event, TS_NOTE_ROWS);
        assert_int_equal(n.flags, 0);
        assert_int_equal(n.n, 1);
        assert_true(n.version == vs[i]);
        assert_string_equal(n.name, "t");
    }
    tsu_expect(q, &f, TS_OP_WAIT, 2, TS_ST_OK);
    uint64_t v;
    uint32_t cnt;
    tsu_state(&f, &v, &cnt);
    tsu_frame_free(&f);
    assert_true(v == vs[0]);
    /* Nothing more for the listener: a PING's reply is the next frame. */
    assert_int_equal(tsh_send(l, TS_OP_PING, 3, NULL, 0), 0);
    tsu_expect(l, &f, TS_OP_PING, 3, TS_ST_OK);
    tsu_frame_free(&f);
    close(w);
    close(l);
    close(q);
}

/* Two connections pipeline writes into disjoint halves; every row ends up as its writer left it. */
static void test_rows_concurrent_writers(void **state)
{
    (void)state;
    int a = tsu_client(&srv), b = tsu_client(&srv);
    make_bin(a, "t");
    enum { WRITES = 50 };
    for (int i = 0; i < WRITES; i++) {
        send_record(a, TS_OP_WRITE_ROWS, 1000 + (uint32_t)i, "t",
                    write_args(i, 1, 1000.0f + (float)i));
        send_record(b, TS_OP_WRITE_ROWS, 2000 + (uint32_t)i, "t",
                    write_args(WRITES + i, 1, 2000.0f + (float)i));
    }
    uint64_t last = 0;
    for (int i = 0; i < WRITES; i++) {
        tsu_frame f;
        uint64_t va, vb;
        uint32_t n;
        tsu_expect(a, &f, TS_OP_WRITE_ROWS, 1000 + (uint32_t)i, TS_ST_OK);
        tsu_state(&f, &va, &n);
        tsu_frame_free(&f);
        tsu_expect(b, &f, TS_OP_WRITE_ROWS, 2000 + (uint32_t)i, TS_ST_OK);
        tsu_state(&f, &vb, &n);
        tsu_frame_free(&f);
        assert_true(va != vb);
        last = va > last ? va : last;
        last = vb > last ? vb : last;
    }
    rows_reply r;
    read_rows(a, "t", 0, NULL, 0, ROWS, &r);
    assert_true(r.version == last);
    for (int i = 0; i < WRITES; i++)
        for (int j = 0; j < COLS; j++) {
            assert_true(r.v[i * COLS + j] == 1000.0f + (float)i);
            assert_true(r.v[(WRITES + i) * COLS + j] == 2000.0f + (float)i);
        }
    close(a);
    close(b);
}

/* Replies count against --max-memory while queued; LIST shows the bin; DELETE frees it all. */
static void test_rows_memory(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "16777216", NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv);
    uint64_t dims[2] = {1024, 1024}; /* 1 MiB of uint8 */
    send_tensor_bin(fd, 1, "t", TS_UINT8, 2, dims);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    uint64_t dims2[1] = {(uint64_t)32 << 20};
    send_tensor_bin(fd, 2, "u", TS_UINT8, 1, dims2); /* 32 MiB: over the limit */
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 2, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    /*
     * A record of 14 MiB and 65 bytes fits beside the first bin, but its buffer, rounded up to
     * 16 MiB, does not: refused, nothing made. One of 12 MiB and 64 bytes (a 14 MiB buffer) fits,
     * and the rounding counted keeps used_memory under the limit.
     */
    uint64_t dims3[1] = {((uint64_t)14 << 20) + 1};
    send_tensor_bin(fd, 10, "r", TS_UINT8, 1, dims3);
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 10, TS_ST_OUT_OF_MEMORY);
    assert_non_null(memmem(f.body, f.len, "rounding of its buffer", 22));
    tsu_frame_free(&f);
    uint64_t dims4[1] = {(uint64_t)12 << 20};
    send_tensor_bin(fd, 11, "r", TS_UINT8, 1, dims4);
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 11, TS_ST_OK);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "used_memory") <= 16777216);
    assert_true(tsu_stat(fd, "overhead_bytes") >= ((int64_t)2 << 20) - 64);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 12, "r", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_DELETE, 12, TS_ST_OK);
    tsu_frame_free(&f);
    /* 20 000 copies of a 1 KiB row: a 20 MB reply, over the limit. */
    enum { N = 20000 };
    static int64_t ix[N];
    for (int i = 0; i < N; i++)
        ix[i] = i % 1024;
    send_record(fd, TS_OP_GATHER_ROWS, 3, "t", gather_args(0, NULL, ix, N));
    tsu_expect(fd, &f, TS_OP_GATHER_ROWS, 3, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    send_record(fd, TS_OP_GATHER_ROWS, 4, "t", gather_args(0, NULL, ix, 1000));
    tsu_expect(fd, &f, TS_OP_GATHER_ROWS, 4, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsh_send(fd, TS_OP_LIST, 5, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LIST, 5, TS_ST_OK);
    assert_int_equal(ts__get_u32le(f.body), 1);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "orphaned_bytes") == 0);
    assert_true(tsu_stat(fd, "bytes") >= (1 << 20));
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 6, "t", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_DELETE, 6, TS_ST_OK);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "bytes") == 0);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
}

/* With --data-dir a tensor bin lives in a file: --max-disk bounds it, not --max-memory. */
static void test_rows_data_dir(void **state)
{
    (void)state;
    char dir[400];
    snprintf(dir, sizeof(dir), "/tmp/ts-rows-dd-%d", (int)getpid());
    const char *args[] = {"--data-dir", dir, "--max-memory", "16777216", NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv);
    uint64_t dims[2] = {(uint64_t)1 << 20, 8}; /* 32 MiB of float32: twice --max-memory */
    send_tensor_bin(fd, 1, "big", TS_FLOAT32, 2, dims);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 1, TS_ST_OK);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "used_memory") < (8 << 20));
    assert_true(tsu_stat(fd, "bytes_reserved") == 0);
    int64_t shape[2] = {1, 8};
    ts_value_t *m = ts_map_new();
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    ((float *)ts_value_tensor(t)->data)[3] = 9.0f;
    ts_map_set(m, "start", ts_int_new((1 << 20) - 1));
    ts_map_set(m, "rows", t);
    send_record(fd, TS_OP_WRITE_ROWS, 2, "big", m);
    tsu_expect(fd, &f, TS_OP_WRITE_ROWS, 2, TS_ST_OK);
    tsu_frame_free(&f);
    send_read_rows(fd, 3, "big", 0, NULL, (1 << 20) - 1, 1 << 20);
    tsu_expect(fd, &f, TS_OP_READ_ROWS, 3, TS_ST_OK);
    rows_reply r;
    parse_rows(&f, &r);
    tsu_frame_free(&f);
    assert_true(r.v[3] == 9.0f && r.v[0] == 0.0f);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 4, "big", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_DELETE, 4, TS_ST_OK);
    tsu_frame_free(&f);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
    char cmd[450];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
    assert_int_equal(system(cmd), 0);
}

/* SAVE writes a tensor bin with its rows; it loads back as a tensor bin. */
static void test_rows_save(void **state)
{
    (void)state;
    char path[400];
    snprintf(path, sizeof(path), "/tmp/ts-rows-save-%d.snap", (int)getpid());
    unlink(path);
    const char *args[] = {"--save", path, NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv);
    make_bin(fd, "t");
    write_rows(fd, "t", 3, 2, 7.0f);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 1, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 1, TS_ST_OK);
    tsu_frame_free(&f);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    assert_int_equal(tsh_server_restart(&srv, args), 0);
    fd = tsu_client(&srv);
    rows_reply r;
    read_rows(fd, "t", 0, NULL, 3, 5, &r);
    assert_true(r.v[0] == 7.0f && r.v[COLS] == 8.0f);
    /* Still a tensor bin (snapshot format 5): PUT is refused, WRITE_ROWS writes in place. */
    size_t rl;
    uint8_t *rec = tsu_rec_int(1, &rl);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 9, "t", rec, rl), 0);
    tsu_rec_free(rec, rl);
    tsu_expect(fd, &f, TS_OP_PUT, 9, TS_ST_INVALID);
    tsu_frame_free(&f);
    write_rows(fd, "t", 10, 1, 5.0f);
    read_rows(fd, "t", 0, NULL, 10, 11, &r);
    assert_true(r.v[0] == 5.0f);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    tsh_server_cleanup(&srv);
    unlink(path);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_rows_tcp, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_unix, start, stop),
        cmocka_unit_test_setup_teardown(test_tensor_bin_refusals, start, stop),
        cmocka_unit_test_setup_teardown(test_tensor_bin_refuses_put_get, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_bad_inputs, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_malformed, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_plain_items, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_notify_and_wait, start, stop),
        cmocka_unit_test_setup_teardown(test_rows_concurrent_writers, start, stop),
        cmocka_unit_test_teardown(test_rows_memory, stop_if_running),
        cmocka_unit_test_teardown(test_rows_save, stop_if_running),
        cmocka_unit_test_teardown(test_rows_data_dir, stop_if_running),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
