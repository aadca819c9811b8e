/*
 * Tensor bins and rows (tensorshare.h "Tensor bins and rows"): TENSOR_BIN and READ_ROWS, whose
 * bodies are encoded here into the request's flat buffer, and GATHER_ROWS and WRITE_ROWS, whose
 * bodies are a name and a record, sent like a PUT's (the record's tensors straight from the
 * caller's memory: a blocking call until its reply, an asynchronous one until its callback
 * unless TS_COPY). Replies are parsed by reply.c by
 * their kind (ITEMS for the row reads, a bin state otherwise).
 */
#include "internal.h"

#include "msg.h"

static int enc_tensor_bin(uint8_t *out, size_t cap, const void *ctx, size_t *len)
{
    return ts__msg_tensor_bin_req_encode(out, cap, ctx, len);
}

static int enc_read_rows(uint8_t *out, size_t cap, const void *ctx, size_t *len)
{
    return ts__msg_read_rows_req_encode(out, cap, ctx, len);
}

/*
 * A GATHER_ROWS or WRITE_ROWS request of kind on bin whose record is root (only read here). Its
 * tensors are sent from their memory, which must stay valid until the call returns (blocking)
 * or until the callback (asynchronous), unless flags has TS_COPY: the record is then copied
 * into the request now. NULL and *rc.
 */
static ts__req *record_req(ts_client_t *c, int kind, uint8_t op, const char *bin,
                           const ts_value_t *root, unsigned flags, int *rc)
{
    /* PUT's body head is a name, the head of these requests too. */
    ts__req *r = ts__api_req_new(c, kind, TS_OP_PUT, bin, rc);
    if (r == NULL)
        return NULL;
    r->op = op;
    ts__enc e;
    *rc = ts__record_plan(root, &e);
    if (*rc != 0) {
        ts__req_free(r);
        ts__fail(*rc, "the %s request cannot be encoded: %s", ts__op_name(op),
                 ts__record_plan_why(*rc));
        return NULL;
    }
    r->body_len = r->small_len + e.total;
    if (flags & TS_COPY) {
        r->flat = ts__malloc_aligned((size_t)e.total);
        if (r->flat == NULL) {
            ts__enc_free(&e);
            ts__req_free(r);
            *rc = ts__fail(TS_ENOMEM, NULL);
            return NULL;
        }
        ts__enc_copy(&e, r->flat);
        r->flat_len = r->flat_cap = (size_t)e.total;
        ts__enc_free(&e);
        return r;
    }
    r->enc = e;
    r->borrowed = 1;
    return r;
}

/* Run r to its end; on success hand back its items (*items) or its version (*version). */
static int finish(ts_client_t *c, ts__req *r, ts_items_t **items, uint64_t *version)
{
    ts__req *done;
    int rc = ts__api_run_blocking(c, r, &done);
    if (rc != 0)
        return rc;
    if (items != NULL) {
        *items = done->res.items;
        done->res.items = NULL;
    }
    if (version != NULL)
        *version = done->res.version;
    ts__req_free(done);
    return 0;
}

/* The TENSOR_BIN request of kind; NULL and *rc. */
static ts__req *tensor_bin_req(ts_client_t *c, int kind, const char *bin, ts_dtype_t dtype,
                               int ndim, const int64_t *shape, int *rc)
{
    if (bin == NULL || ndim < 1 || ndim > TS_MAX_NDIM || shape == NULL ||
        ts_dtype_size(dtype) == 0) {
        *rc = ts__fail(TS_EINVAL, "a tensor bin needs a name, a known dtype and 1 to %d dims",
                       TS_MAX_NDIM);
        return NULL;
    }
    ts__msg_tensor_bin_req m = {.name = (const uint8_t *)bin,
                                .name_len = strlen(bin),
                                .dtype = (uint8_t)dtype,
                                .ndim = (uint8_t)ndim};
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) {
            *rc = ts__fail(TS_EINVAL, "dim %d is negative", i);
            return NULL;
        }
        m.dims[i] = (uint64_t)shape[i];
    }
    if (m.name_len > TS_MAX_NAME_LEN) {
        *rc = ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", m.name_len,
                       TS_MAX_NAME_LEN);
        return NULL;
    }
    return ts__api_flat_req(c, kind, TS_OP_TENSOR_BIN,
                            ts__msg_tensor_bin_req_size(m.name_len, m.ndim), enc_tensor_bin, &m, 0,
                            rc);
}

/* The READ_ROWS request of kind; NULL and *rc. */
static ts__req *read_req(ts_client_t *c, int kind, const char *bin, int item, const char *key,
                         int64_t start, int64_t end, int *rc)
{
    if (bin == NULL || start < 0 || end < start) {
        *rc = ts__fail(TS_EINVAL, "rows [%lld, %lld) of a bin", (long long)start, (long long)end);
        return NULL;
    }
    ts__msg_read_rows_req m = {.name = (const uint8_t *)bin,
                               .name_len = strlen(bin),
                               .item = (int32_t)item,
                               .key = (const uint8_t *)key,
                               .key_len = key != NULL ? strlen(key) : 0,
                               .start = (uint64_t)start,
                               .end = (uint64_t)end};
    if (m.name_len > TS_MAX_NAME_LEN) {
        *rc = ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", m.name_len,
                       TS_MAX_NAME_LEN);
        return NULL;
    }
    if (m.key_len > TS_MSG_MAX_ROWS_KEY) {
        *rc = ts__fail(TS_EINVAL, "key of %zu bytes (at most %d)", m.key_len, TS_MSG_MAX_ROWS_KEY);
        return NULL;
    }
    return ts__api_flat_req(c, kind, TS_OP_READ_ROWS,
                            ts__msg_read_rows_req_size(m.name_len, m.key_len), enc_read_rows, &m, 0,
                            rc);
}

/* The GATHER_ROWS request of kind; NULL and *rc. */
static ts__req *gather_req(ts_client_t *c, int kind, const char *bin, int item, const char *key,
                           const int64_t *index, size_t n, unsigned flags, int *rc)
{
    if (bin == NULL || (index == NULL && n > 0) || n > (size_t)INT64_MAX) {
        *rc = ts__fail(TS_EINVAL, "a gather needs a bin and an index array");
        return NULL;
    }
    ts_value_t *m = ts_map_new();
    int64_t len = (int64_t)n;
    *rc = m == NULL ? TS_ENOMEM : 0;
    if (*rc == 0 && item != 0)
        *rc = ts_map_set(m, "item", ts_int_new(item));
    if (*rc == 0 && key != NULL && key[0] != '\0')
        *rc = ts_map_set(m, "key", ts_string_new(key, strlen(key)));
    if (*rc == 0)
        *rc = ts_map_set(m, "index", ts_tensor_new(TS_INT64, 1, &len, index, TS_BORROW));
    if (*rc != 0) {
        ts_value_free(m);
        *rc = ts__fail(*rc, NULL);
        return NULL;
    }
    ts__req *r = record_req(c, kind, TS_OP_GATHER_ROWS, bin, m, flags, rc);
    ts_value_free(m); /* the plan keeps the meta; the index is read from its own memory */
    return r;
}

/* The WRITE_ROWS request of kind; NULL and *rc. */
static ts__req *write_req(ts_client_t *c, int kind, const char *bin, int64_t start,
                          const ts_value_t *rows, unsigned flags, int *rc)
{
    if (bin == NULL || rows == NULL || ts_value_type(rows) != TS_TYPE_TENSOR || start < 0) {
        *rc = ts__fail(TS_EINVAL, "a row write needs a bin, a start >= 0 and a tensor of rows");
        return NULL;
    }
    ts_value_t *m = ts_map_new();
    *rc = m == NULL ? TS_ENOMEM : ts_map_set(m, "start", ts_int_new(start));
    if (*rc == 0)
        *rc = ts_map_set(m, "rows", ts_value_borrow(rows));
    if (*rc != 0) {
        ts_value_free(m);
        *rc = ts__fail(*rc, NULL);
        return NULL;
    }
    ts__req *r = record_req(c, kind, TS_OP_WRITE_ROWS, bin, m, flags, rc);
    ts_value_free(m); /* the rows are read from their own memory (or were copied) */
    return r;
}

/* Submit an asynchronous request r (NULL: building it failed with rc). */
static int submit(ts_client_t *c, ts__req *r, int rc, ts_result_cb cb, void *arg)
{
    if (r == NULL)
        return rc;
    return ts__api_run_async(c, r, cb, arg);
}

int ts_tensor_bin_create(ts_client_t *c, const char *bin, ts_dtype_t dtype, int ndim,
                         const int64_t *shape, uint64_t *version)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__req *r = tensor_bin_req(c, TS__K_BLOCK, bin, dtype, ndim, shape, &rc);
    return r == NULL ? rc : finish(c, r, NULL, version);
}

int ts_rows_read(ts_client_t *c, const char *bin, int item, const char *key, int64_t start,
                 int64_t end, ts_items_t **out)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    ts__req *r = read_req(c, TS__K_BLOCK, bin, item, key, start, end, &rc);
    return r == NULL ? rc : finish(c, r, out, NULL);
}

int ts_rows_gather(ts_client_t *c, const char *bin, int item, const char *key, const int64_t *index,
                   size_t n, ts_items_t **out)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    ts__req *r = gather_req(c, TS__K_BLOCK, bin, item, key, index, n, TS_BORROW, &rc);
    return r == NULL ? rc : finish(c, r, out, NULL);
}

int ts_rows_write(ts_client_t *c, const char *bin, int64_t start, const ts_value_t *rows,
                  uint64_t *version)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__req *r = write_req(c, TS__K_BLOCK, bin, start, rows, TS_BORROW, &rc);
    return r == NULL ? rc : finish(c, r, NULL, version);
}

int ts_tensor_bin_create_async(ts_client_t *c, const char *bin, ts_dtype_t dtype, int ndim,
                               const int64_t *shape, ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = tensor_bin_req(c, TS__K_ASYNC, bin, dtype, ndim, shape, &rc);
    return submit(c, r, rc, cb, arg);
}

int ts_rows_read_async(ts_client_t *c, const char *bin, int item, const char *key, int64_t start,
                       int64_t end, ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = read_req(c, TS__K_ASYNC, bin, item, key, start, end, &rc);
    return submit(c, r, rc, cb, arg);
}

int ts_rows_gather_async(ts_client_t *c, const char *bin, int item, const char *key,
                         const int64_t *index, size_t n, unsigned flags, ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = gather_req(c, TS__K_ASYNC, bin, item, key, index, n, flags, &rc);
    return submit(c, r, rc, cb, arg);
}

int ts_rows_write_async(ts_client_t *c, const char *bin, int64_t start, const ts_value_t *rows,
                        unsigned flags, ts_result_cb cb, void *arg)
{
    c = ts__route(c, bin);
    int rc = ts__api_check_call(c, 0);
    if (rc != 0)
        return rc;
    ts__req *r = write_req(c, TS__K_ASYNC, bin, start, rows, flags, &rc);
    return submit(c, r, rc, cb, arg);
}
