/* Helpers for the tensord integration tests (see test_server_util.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <string.h>
#include <unistd.h>

#include "record.h"
#include "test_server_util.h"

void tsu_frame_free(tsu_frame *f)
{
    /* The harness allocates received bodies with plain malloc. */
    free(f->body);
    f->body = NULL;
    f->len = 0;
}

uint8_t *tsu_rec_int(int64_t v, size_t *len)
{
    ts_value_t *x = ts_int_new(v);
    assert_non_null(x);
    uint8_t *rec = NULL;
    assert_int_equal(ts__record_encode(x, &rec, len), 0);
    ts_value_free(x);
    return rec;
}

uint8_t *tsu_rec_bytes(size_t n, unsigned seed, size_t *len)
{
    uint8_t *data = ts__malloc(n > 0 ? n : 1);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++)
        data[i] = (uint8_t)(i + seed);
    int64_t shape[1] = {(int64_t)n};
    ts_value_t *m = ts_map_new();
    assert_non_null(m);
    assert_int_equal(ts_map_set(m, "t", ts_tensor_new(TS_UINT8, 1, shape, data, TS_BORROW)), 0);
    uint8_t *rec = NULL;
    assert_int_equal(ts__record_encode(m, &rec, len), 0);
    ts_value_free(m);
    ts__free(data);
    return rec;
}

uint8_t *tsu_rec_tensor_raw(uint8_t dtype, uint8_t ndim, const uint64_t *dims, uint64_t off,
                            uint64_t len, uint64_t data_len, size_t *out_len)
{
    size_t meta_len = 5 + 8 * (size_t)ndim + 16;
    size_t data_start = ts__align_up(TS_REC_HDR_SIZE + meta_len, TS__ALIGN);
    size_t total = data_start + (size_t)data_len;
    uint8_t *rec = ts__malloc_aligned(total);
    assert_non_null(rec);
    memset(rec, 0, total);
    rec[0] = TS_REC_MAGIC0;
    rec[1] = TS_REC_MAGIC1;
    rec[2] = TS_REC_MAGIC2;
    rec[3] = TS_REC_MAGIC3;
    ts__put_u32le(rec + 4, (uint32_t)meta_len);
    ts__put_u64le(rec + 8, data_len);
    uint8_t *m = rec + TS_REC_HDR_SIZE;
    m[0] = TS_TYPE_TENSOR;
    m[1] = dtype;
    m[2] = ndim;
    for (size_t i = 0; i < ndim; i++)
        ts__put_u64le(m + 5 + 8 * i, dims[i]);
    ts__put_u64le(m + 5 + 8 * (size_t)ndim, off);
    ts__put_u64le(m + 13 + 8 * (size_t)ndim, len);
    *out_len = total;
    return rec;
}

void tsu_rec_free(uint8_t *rec, size_t len)
{
    ts__free_aligned(rec, len);
}

int tsu_client(const tsh_server *s)
{
    int fd = tsh_connect_tcp(s->port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    return fd;
}

int tsu_recv(int fd, tsu_frame *f)
{
    return tsh_recv(fd, &f->h, &f->body, &f->len);
}

void tsu_expect(int fd, tsu_frame *f, uint8_t op, uint32_t rid, uint16_t status)
{
    assert_int_equal(tsu_recv(fd, f), 0);
    if (f->h.opcode != op || f->h.request_id != rid || f->h.status != status)
        print_error("got op 0x%02x rid %u status %u (%.*s), want op 0x%02x rid %u status %u\n",
                    f->h.opcode, f->h.request_id, f->h.status, f->h.status != 0 ? (int)f->len : 0,
                    f->body != NULL ? (char *)f->body : "", op, rid, status);
    assert_int_equal(f->h.opcode, op);
    assert_int_equal(f->h.request_id, rid);
    assert_int_equal(f->h.status, status);
}

int tsu_send_store(int fd, uint8_t op, uint32_t rid, const char *name, const void *rec, size_t len)
{
    size_t nl = strlen(name);
    size_t blen = 1 + nl + len;
    uint8_t *body = ts__malloc(blen);
    assert_non_null(body);
    body[0] = (uint8_t)nl;
    memcpy(body + 1, name, nl);
    if (len > 0)
        memcpy(body + 1 + nl, rec, len);
    int rc = tsh_send(fd, op, rid, body, blen);
    ts__free(body);
    return rc;
}

int tsu_send_name(int fd, uint8_t op, uint32_t rid, const char *name, const void *extra,
                  size_t extra_len)
{
    uint8_t body[512];
    size_t n = tsh_name_body(body, sizeof(body), name, extra, extra_len);
    return tsh_send(fd, op, rid, body, n);
}

int tsu_send_get(int fd, uint8_t op, uint32_t rid, const char *name, uint32_t max_items)
{
    uint8_t extra[4];
    ts__put_u32le(extra, max_items);
    return tsu_send_name(fd, op, rid, name, extra, sizeof(extra));
}

int tsu_send_wait(int fd, uint32_t rid, const char *name, uint64_t after, uint32_t timeout_ms)
{
    uint8_t extra[12];
    ts__put_u64le(extra, after);
    ts__put_u32le(extra + 8, timeout_ms);
    return tsu_send_name(fd, TS_OP_WAIT, rid, name, extra, sizeof(extra));
}

void tsu_state(const tsu_frame *f, uint64_t *version, uint32_t *n)
{
    assert_int_equal(f->len, TS_BIN_STATE_SIZE);
    *version = ts__get_u64le(f->body);
    *n = ts__get_u32le(f->body + 8);
    assert_int_equal(ts__get_u32le(f->body + 12), 0);
}

static uint32_t next_rid = 1000;

uint64_t tsu_store(int fd, uint8_t op, const char *name, const void *rec, size_t len, uint32_t *n)
{
    uint32_t rid = next_rid++;
    assert_int_equal(tsu_send_store(fd, op, rid, name, rec, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, op, rid, TS_ST_OK);
    uint64_t v;
    uint32_t k;
    tsu_state(&f, &v, &k);
    tsu_frame_free(&f);
    if (n != NULL)
        *n = k;
    return v;
}

uint64_t tsu_put_int(int fd, uint8_t op, const char *name, int64_t v, uint32_t *n)
{
    size_t len;
    uint8_t *rec = tsu_rec_int(v, &len);
    uint64_t ver = tsu_store(fd, op, name, rec, len, n);
    tsu_rec_free(rec, len);
    return ver;
}

void tsu_get(int fd, uint8_t op, const char *name, uint32_t max_items, tsu_items *out)
{
    memset(out, 0, sizeof(*out));
    uint32_t rid = next_rid++;
    assert_int_equal(tsu_send_get(fd, op, rid, name, max_items), 0);
    tsu_expect(fd, &out->f, op, rid, TS_ST_OK);
    const uint8_t *b = out->f.body;
    assert_true(out->f.len >= 64);
    out->version = ts__get_u64le(b);
    out->n = ts__get_u32le(b + 8);
    out->remaining = ts__get_u32le(b + 12);
    assert_true(out->n <= 64);
    size_t head = (size_t)ts__items_head_size(out->n);
    for (size_t i = 16 + 8 * (size_t)out->n; i < head; i++)
        assert_int_equal(b[i], 0);
    size_t off = head;
    for (uint32_t i = 0; i < out->n; i++) {
        out->item_len[i] = ts__get_u64le(b + 16 + 8 * (size_t)i);
        out->item[i] = b + off;
        size_t padded = ts__align_up((size_t)out->item_len[i], TS__ALIGN);
        assert_true(off + padded <= out->f.len);
        for (size_t k = off + (size_t)out->item_len[i]; k < off + padded; k++)
            assert_int_equal(b[k], 0);
        off += padded;
    }
    assert_int_equal(off, out->f.len);
}

int64_t tsu_item_int(const uint8_t *rec, size_t len)
{
    assert_true(len >= TS_REC_HDR_SIZE + 9);
    assert_int_equal(rec[TS_REC_HDR_SIZE], TS_TYPE_INT);
    return (int64_t)ts__get_u64le(rec + TS_REC_HDR_SIZE + 1);
}

int64_t tsu_stat(int fd, const char *key)
{
    uint32_t rid = next_rid++;
    assert_int_equal(tsh_send(fd, TS_OP_STATS, rid, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_STATS, rid, TS_ST_OK);
    assert_int_equal(ts__record_validate(f.body, f.len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    uint8_t *copy = ts__malloc_aligned(f.len);
    assert_non_null(copy);
    memcpy(copy, f.body, f.len);
    ts__rbuf *rb = ts__rbuf_new(copy, f.len, NULL);
    assert_non_null(rb);
    ts_value_t *root = ts__record_decode(rb, 0, f.len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    assert_non_null(root);
    int64_t v = 0;
    int rc = ts_map_get_int(root, key, &v);
    if (rc != 0)
        print_error("STATS has no key %s\n", key);
    assert_int_equal(rc, 0);
    ts__record_tree_free(root);
    tsu_frame_free(&f);
    return v;
}

void tsu_check_healthy(const tsh_server *s)
{
    int fd = tsu_client(s);
    uint32_t n;
    uint64_t v1 = tsu_put_int(fd, TS_OP_PUT, "health check", 42, &n);
    assert_int_equal(n, 1);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "health check", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.version, v1);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 42);
    tsu_frame_free(&it.f);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 7, "health check", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_DELETE, 7, TS_ST_OK);
    uint64_t v2;
    tsu_state(&f, &v2, &n);
    assert_true(v2 > v1);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    close(fd);
}

void tsu_expect_error_close(int fd, uint16_t status)
{
    tsu_frame f;
    assert_int_equal(tsu_recv(fd, &f), 0);
    if (f.h.status != status)
        print_error("status %u (%.*s), want %u\n", f.h.status, (int)f.len,
                    f.body != NULL ? (char *)f.body : "", status);
    assert_int_equal(f.h.status, status);
    /* Every error reply names the problem. */
    assert_true(f.len > 0 && f.len <= TS_MAX_ERRMSG);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
}

void tsu_note_parse(const tsu_frame *f, tsu_note *n)
{
    assert_int_equal(f->h.opcode, TS_OP_NOTIFY);
    assert_int_equal(f->h.request_id, 0);
    assert_true(f->len >= TS_NOTIFY_FIXED);
    n->version = ts__get_u64le(f->body);
    n->n = ts__get_u32le(f->body + 8);
    n->event = f->body[12];
    n->flags = f->body[13];
    size_t nl = f->body[14];
    assert_int_equal(f->len, TS_NOTIFY_FIXED + nl);
    memcpy(n->name, f->body + 15, nl);
    n->name[nl] = '\0';
}
