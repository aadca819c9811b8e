/*
 * Tensor bins kept by snapshots (format 5, docs/PROTOCOL.md 8.19): a tensor bin with rows written
 * into it, saved by SAVE and by the final snapshot at SIGTERM, comes back after a restart as a
 * tensor bin of the same dtype, shape, rows and version, in a memfd (as TENSOR_BIN makes one),
 * counted in the store's bytes as before; WRITE_ROWS works on it, PUT, APPEND and GET are refused;
 * a plain bin beside it stays plain. A format 4 file (written by the writer in that format: bin
 * flags did not exist) loads as before, its tensor record a plain bin, and the next file written
 * is format 5. A damaged flag (an unknown bit, the tensor flag on a bin of three items, on an int
 * or on a map holding a tensor, a flag in a format 4 file) is refused with exit status 3 and a line
 * naming the file and the problem.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "msg.h"
#include "record.h"
#include "snapfile_fix.h"
#include "test_harden_util.h"

#define ROWS 64 /* rows of the tensor bin the tests make */
#define COLS 16 /* float32 columns per row */

static th_saving sv; /* the tensord under test, saving into sv.snap */

static int teardown(void **state)
{
    (void)state;
    th_saving_teardown(&sv);
    return 0;
}

static ts_client_t *open_client(void)
{
    ts_client_t *c = NULL;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 20000;
    assert_int_equal(ts_client_open(&c, sv.srv.addr, &o), 0);
    return c;
}

/* Write k rows from start, row r's column j holding r * 100 + j + add. Returns the version. */
static uint64_t write_rows(ts_client_t *c, int64_t start, int64_t k, float add)
{
    int64_t shape[2] = {k, COLS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(t);
    float *f = ts_value_tensor(t)->data;
    for (int64_t r = 0; r < k; r++)
        for (int j = 0; j < COLS; j++)
            f[r * COLS + j] = (float)((start + r) * 100 + j) + add;
    uint64_t version = 0;
    assert_int_equal(ts_rows_write(c, "t", start, t, &version), 0);
    ts_value_free(t);
    return version;
}

/*
 * The tensor bin "t" is float32 [ROWS, COLS], its version is version, and its rows [start, start
 * + k) hold what write_rows wrote with add; every other row read is zero.
 */
static void expect_rows(ts_client_t *c, uint64_t version, int64_t start, int64_t k, float add)
{
    ts_items_t *it = NULL;
    assert_int_equal(ts_rows_read(c, "t", 0, NULL, 0, ROWS, &it), 0);
    assert_int_equal(ts_items_version(it), version);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(it, 0));
    assert_non_null(t);
    assert_int_equal(t->dtype, TS_FLOAT32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], ROWS);
    assert_int_equal(t->shape[1], COLS);
    const float *f = t->data;
    for (int64_t r = 0; r < ROWS; r++)
        for (int j = 0; j < COLS; j++) {
            float want = r >= start && r < start + k ? (float)(r * 100 + j) + add : 0.0f;
            if (f[r * COLS + j] != want) {
                print_error("row %lld col %d: %g, want %g\n", (long long)r, j,
                            (double)f[r * COLS + j], (double)want);
                fail();
            }
        }
    ts_items_free(it);
}

/* PUT, APPEND and GET refused on "t" (TS_EINVAL), as on any tensor bin. */
static void expect_tensor_bin(ts_client_t *c)
{
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(c, "t", one, NULL), TS_EINVAL);
    assert_int_equal(ts_append(c, "t", one, NULL), TS_EINVAL);
    ts_value_free(one);
    ts_items_t *it = NULL;
    assert_int_equal(ts_get(c, "t", 1, &it), TS_EINVAL);
}

/* The bytes of bin "t"'s flags word in a file holding the bins "p" and "t" in that order. */
static size_t flags_of_t(const uint8_t *file, size_t len)
{
    size_t off = TSD_SNAP_HDR_SIZE;
    for (int b = 0; b < 2; b++) {
        assert_true(off + 17 < len);
        size_t nl = file[off];
        uint32_t n = ts__get_u32le(file + off + 1 + nl + 8);
        if (nl == 1 && file[off + 1] == 't')
            return off + 1 + nl + 12;
        const uint8_t *lens = file + off + 17 + nl;
        off += 17 + nl + (size_t)n * 8 + 8;
        for (uint32_t i = 0; i < n; i++)
            off += (size_t)ts__get_u64le(lens + (size_t)i * 8) + 8;
    }
    fail_msg("no bin 't' in the file");
    return 0;
}

static void test_tensor_bin_survives_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    ts_client_t *c = open_client();
    int64_t shape[2] = {ROWS, COLS};
    assert_int_equal(ts_tensor_bin_create(c, "t", TS_FLOAT32, 2, shape, NULL), 0);
    write_rows(c, 3, 5, 9.0f);
    uint64_t version = write_rows(c, 3, 5, 0.5f);
    ts_value_t *one = ts_int_new(7);
    assert_int_equal(ts_put(c, "p", one, NULL), 0);
    assert_int_equal(ts_save(c), 0);
    ts_client_free(c);
    int fd = tsu_client(&sv.srv);
    int64_t bytes = tsu_stat(fd, "bytes");
    close(fd);
    tsh_server_kill(&sv.srv); /* what SAVE wrote, not the final snapshot */
    size_t len;
    uint8_t *file = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(file + 8), TSD_SNAP_FORMAT);
    assert_int_equal(ts__get_u32le(file + flags_of_t(file, len)), TSD_SNAP_BIN_TENSOR);
    free(file);

    th_saving_restart(&sv);
    c = open_client();
    /* Made as TENSOR_BIN makes it: in a memfd, the same bytes held as before. */
    fd = tsu_client(&sv.srv);
    assert_true(tsu_stat(fd, "shm_items") >= 1);
    assert_int_equal(tsu_stat(fd, "bytes"), bytes);
    close(fd);
    expect_rows(c, version, 3, 5, 0.5f);
    expect_tensor_bin(c);
    /* A plain bin beside it stays plain: PUT replaces it. */
    assert_int_equal(ts_put(c, "p", one, NULL), 0);
    /* WRITE_ROWS works on it and moves its version on. */
    for (int64_t r = 0; r < ROWS; r += 8)
        version = write_rows(c, r, 8, 0.25f);
    expect_rows(c, version, 0, ROWS, 0.25f);
    ts_client_free(c);
    /* The final snapshot at SIGTERM keeps it a tensor bin too. */
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    c = open_client();
    expect_rows(c, version, 0, ROWS, 0.25f);
    expect_tensor_bin(c);
    version = write_rows(c, 10, 2, 1.0f);
    assert_int_equal(ts_delete(c, "t", NULL), 0);
    /* Its name is free again for a plain bin. */
    assert_int_equal(ts_put(c, "t", one, NULL), 0);
    ts_value_free(one);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/* The records of the format 4 file's bins: "p" an int, "t" a tensor bin's record. */
typedef struct old_items {
    uint8_t *rec[2];
    size_t len[2];
} old_items;

static void old_item(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const old_items *o = arg;
    assert_true(index < 2);
    *data = o->rec[index];
    *len = o->len[index];
}

/* A tensor bin's record, float32 [ROWS, COLS], laid out as TENSOR_BIN lays it out, all 1.0. */
static uint8_t *tensor_bin_record(size_t *len)
{
    uint64_t dims[2] = {ROWS, COLS};
    uint64_t size;
    assert_int_equal(ts__rows_rec_size(TS_FLOAT32, 2, dims, &size), 0);
    uint8_t *rec = calloc(1, (size_t)size);
    assert_non_null(rec);
    size_t head = ts__rows_rec_head_size(2);
    ts__rows_rec_head_write(rec, TS_FLOAT32, 2, dims, size - head);
    float one = 1.0f;
    for (size_t i = 0; i < ROWS * COLS; i++)
        memcpy(rec + head + i * sizeof(float), &one, sizeof(float));
    *len = (size_t)size;
    return rec;
}

/* A record whose root is a map holding a tensor: a plain bin's, never a tensor bin's. */
static uint8_t *map_record(size_t *len)
{
    int64_t shape[2] = {ROWS, COLS};
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "x", ts_tensor_alloc(TS_FLOAT32, 2, shape)), 0);
    uint8_t *enc;
    assert_int_equal(ts__record_encode(m, &enc, len), 0);
    ts_value_free(m);
    uint8_t *rec = malloc(*len);
    assert_non_null(rec);
    memcpy(rec, enc, *len);
    ts__free_aligned(enc, *len);
    return rec;
}

/*
 * Write the bins "p" (an int) and "t" (a tensor bin's record, or with map a map's; flags given)
 * in format.
 */
static void write_file(const char *path, uint32_t format, uint32_t t_flags, int map, int expect_rc)
{
    old_items o;
    o.rec[0] = tsu_rec_int(1, &o.len[0]);
    o.rec[1] = map ? map_record(&o.len[1]) : tensor_bin_record(&o.len[1]);
    tsd_snapfile_bin bins[2] = {
        {.name = (const uint8_t *)"p", .name_len = 1, .version = 2, .n_items = 1, .first = 0},
        {.name = (const uint8_t *)"t",
         .name_len = 1,
         .version = 5,
         .n_items = 1,
         .first = 1,
         .flags = t_flags},
    };
    tsd_snapfile_head head = {
        .counter = 5, .n_bins = 2, .n_items = 2, .bytes = o.len[0] + o.len[1], .format = format};
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(tsd_snapfile_write_ps(fileno(f), &head, bins, NULL, NULL, NULL, old_item, &o),
                     expect_rc);
    fclose(f);
    tsu_rec_free(o.rec[0], o.len[0]);
    free(o.rec[1]);
}

static void test_format_4_loads(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    /* Format 4 has no bin flags: the writer refuses a tensor bin in it. */
    write_file(sv.snap, 4, TSD_SNAP_BIN_TENSOR, 0, -EINVAL);
    write_file(sv.snap, 4, 0, 0, 0);
    size_t len;
    uint8_t *old = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(old + 8), 4);
    free(old);
    th_saving_restart(&sv);
    ts_client_t *c = open_client();
    /* As before format 5: the tensor record is a plain bin, WRITE_ROWS refused, PUT replaces. */
    ts_items_t *it = NULL;
    assert_int_equal(ts_peek(c, "t", 1, &it), 0);
    assert_int_equal(ts_items_version(it), 5);
    ts_items_free(it);
    int64_t shape[2] = {1, COLS};
    ts_value_t *row = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_int_equal(ts_rows_write(c, "t", 0, row, NULL), TS_EINVAL);
    ts_value_free(row);
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(c, "t", one, NULL), 0);
    ts_value_free(one);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    uint8_t *now = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(now + 8), TSD_SNAP_FORMAT);
    free(now);
}

static void test_damaged_flag_refused(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    write_file(sv.snap, TSD_SNAP_FORMAT, TSD_SNAP_BIN_TENSOR, 0, 0);
    size_t len;
    uint8_t *good = th_read_file(sv.snap, &len);
    size_t ft = flags_of_t(good, len);
    size_t fp = TSD_SNAP_HDR_SIZE + 1 + 1 + 12; /* "p"'s flags, the first bin */
    uint8_t *bad = malloc(len);
    assert_non_null(bad);
    /* The good file loads: "t" is a tensor bin. */
    th_saving_restart(&sv);
    ts_client_t *c = open_client();
    expect_tensor_bin(c);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    /* An unknown bit. */
    memcpy(bad, good, len);
    ts__put_u32le(bad + ft, TSD_SNAP_BIN_TENSOR | 0x2u);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "bin 't': unknown flags 0x2");
    /* A bin version above the header's change counter: the next PUT would repeat it. */
    memcpy(bad, good, len);
    uint64_t counter = ts__get_u64le(bad + 16);
    ts__put_u64le(bad + ft - 12, counter + 1);
    snapfix_rehash(bad, len);
    char want[100];
    snprintf(want, sizeof(want), "bin 't' has version %llu, above the file's change counter %llu",
             (unsigned long long)(counter + 1), (unsigned long long)counter);
    th_saving_expect_refused(&sv, bad, len, want);
    /* The tensor flag on an int record. */
    memcpy(bad, good, len);
    ts__put_u32le(bad + fp, TSD_SNAP_BIN_TENSOR);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len,
                             "bin 'p' is marked a tensor bin but its record is not one tensor");
    /* The flags in a format 4 file: there they are a reserved field. */
    memcpy(bad, good, len);
    ts__put_u32le(bad + 8, 4);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "bin 't': a reserved field is not 0");
    free(bad);
    free(good);
    /* The tensor flag on a map holding a tensor. */
    write_file(sv.copy, TSD_SNAP_FORMAT, TSD_SNAP_BIN_TENSOR, 1, 0);
    good = th_read_file(sv.copy, &len);
    th_saving_expect_refused(&sv, good, len,
                             "bin 't' is marked a tensor bin but its record is not one tensor");
    free(good);
    /* The tensor flag on a bin of three items. */
    th_saving_restart(&sv);
    c = open_client();
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_append(c, "p", one, NULL), 0);
    assert_int_equal(ts_append(c, "p", one, NULL), 0);
    ts_value_free(one);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    good = th_read_file(sv.snap, &len);
    bad = malloc(len);
    assert_non_null(bad);
    memcpy(bad, good, len);
    ts__put_u32le(bad + fp, TSD_SNAP_BIN_TENSOR);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len,
                             "bin 'p' is marked a tensor bin but holds 3 items, not 1");
    free(bad);
    free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tensor_bin_survives_restart, teardown),
        cmocka_unit_test_teardown(test_format_4_loads, teardown),
        cmocka_unit_test_teardown(test_damaged_flag_refused, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
