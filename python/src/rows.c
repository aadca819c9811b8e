/*
 * Tensor bins and rows for tensorshare.Client (tensorshare.h "Tensor bins and rows"):
 *   create_tensor_bin(bin, dtype, shape) -> int version
 *   read_rows(bin, start, end, *, item=0, key=None, tensor_type=None) -> tensor
 *   gather_rows(bin, index, *, item=0, key=None, tensor_type=None) -> tensor
 *   write_rows(bin, start, rows) -> int version
 * Each blocks with the GIL released. A returned tensor is a view of the reply's memory (a copy of
 * the rows the server made when it handled the request), like any received tensor (tsp.h).
 */
#include "tsp.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>

/* The name of a dtype given as a str ("float32"), a numpy dtype or a torch dtype. */
static ts_dtype_t dtype_arg(PyObject *obj)
{
    /* numpy scalar types (numpy.float32) name their dtype in __name__ ("bool_" for bool). */
    PyObject *s = PyUnicode_Check(obj) ? (Py_INCREF(obj), obj)
                  : PyType_Check(obj)  ? PyObject_GetAttrString(obj, "__name__")
                                       : PyObject_Str(obj);
    if (s == NULL)
        return TS_DTYPE_INVALID;
    const char *name = tsp_c_string(s);
    ts_dtype_t d = TS_DTYPE_INVALID;
    if (name == NULL && !PyErr_Occurred())
        PyErr_Format(tsp_state.InvalidArgumentError, "unknown dtype %R", obj);
    if (name != NULL) {
        /* str(torch.float32) is "torch.float32"; str(numpy.dtype("float32")) is "float32". */
        if (strncmp(name, "torch.", 6) == 0)
            name += 6;
        d = ts_dtype_from_name(name);
        if (d == TS_DTYPE_INVALID && (strcmp(name, "bool") == 0 || strcmp(name, "bool_") == 0))
            d = TS_BOOL;
        if (d == TS_DTYPE_INVALID)
            PyErr_Format(tsp_state.InvalidArgumentError, "unknown dtype %R", obj);
    }
    Py_DECREF(s);
    return d;
}

/* A shape (a sequence of ints) into shape[TS_MAX_NDIM]; 0 and *ndim, or -1 with an exception. */
static int shape_arg(PyObject *obj, int64_t *shape, int *ndim)
{
    PyObject *seq = PySequence_Fast(obj, "shape must be a sequence of ints");
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n < 1 || n > TS_MAX_NDIM) {
        Py_DECREF(seq);
        PyErr_Format(tsp_state.InvalidArgumentError, "a tensor bin has 1 to %d dimensions, not %zd",
                     TS_MAX_NDIM, n);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        char what[32];
        long long v = 0;
        snprintf(what, sizeof(what), "shape[%zd]", i);
        if (tsp_int_arg(PySequence_Fast_GET_ITEM(seq, i), what, INT64_MIN, INT64_MAX, &v) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        shape[i] = (int64_t)v;
    }
    Py_DECREF(seq);
    *ndim = (int)n;
    return 0;
}

/* The item argument (absent: 0, the oldest; -1 the newest): an int. -1 with an exception. */
static int item_arg(PyObject *obj, int *item)
{
    long long v = *item;
    if (tsp_int_arg(obj, "item", INT_MIN, INT_MAX, &v) < 0)
        return -1;
    *item = (int)v;
    return 0;
}

/* The key argument: None or a str (UTF-8). NULL with *key NULL for None; -1 on error. */
static int key_arg(PyObject *obj, const char **key)
{
    *key = NULL;
    if (obj == NULL || obj == Py_None)
        return 0;
    *key = tsp_c_string(obj);
    if (*key == NULL && !PyErr_Occurred())
        tsp_raise_msg(TS_EINVAL, "a key cannot contain NUL characters");
    return *key == NULL ? -1 : 0;
}

/* The one tensor of a row reply as a Python tensor; frees items. */
static PyObject *rows_result(ts_items_t *items, tsp_tensor_type_t tt)
{
    const ts_value_t *v = ts_items_at(items, 0);
    PyObject *r = v != NULL ? tsp_value_to_py(v, tt)
                            : tsp_raise_msg(TS_EPROTO, "the server's reply holds no rows");
    ts_items_free(items);
    return r;
}

PyObject *tsp_client_create_tensor_bin(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bin", "dtype", "shape", NULL};
    const char *bin;
    PyObject *dtype_obj, *shape_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO:create_tensor_bin", names, &bin, &dtype_obj,
                                     &shape_obj))
        return NULL;
    ts_dtype_t dtype = dtype_arg(dtype_obj);
    int64_t shape[TS_MAX_NDIM];
    int ndim = 0;
    if (dtype == TS_DTYPE_INVALID || shape_arg(shape_obj, shape, &ndim) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_tensor_bin_create(c, bin, dtype, ndim, shape, &version);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_read_rows(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bin", "start", "end", "item", "key", "tensor_type", NULL};
    const char *bin, *key;
    long long start = 0, end = 0;
    int item = 0;
    PyObject *start_obj, *end_obj, *item_obj = NULL, *key_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|$OOO:read_rows", names, &bin, &start_obj,
                                     &end_obj, &item_obj, &key_obj, &tt_obj) ||
        tsp_int_arg(start_obj, "start", INT64_MIN, INT64_MAX, &start) < 0 ||
        tsp_int_arg(end_obj, "end", INT64_MIN, INT64_MAX, &end) < 0 ||
        item_arg(item_obj, &item) < 0 || key_arg(key_obj, &key) < 0)
        return NULL;
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_items_t *items = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        ts_rows_read(c, bin, item, key, (int64_t)start, (int64_t)end, &items);
    Py_END_ALLOW_THREADS PyObject *r = rc == 0 ? rows_result(items, tt) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_gather_rows(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bin", "index", "item", "key", "tensor_type", NULL};
    const char *bin, *key;
    int item = 0;
    PyObject *index_obj, *item_obj = NULL, *key_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|$OOO:gather_rows", names, &bin, &index_obj,
                                     &item_obj, &key_obj, &tt_obj) ||
        item_arg(item_obj, &item) < 0 || key_arg(key_obj, &key) < 0)
        return NULL;
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    /*
     * The index: any int64 tensor of one dimension (numpy, torch, a buffer), sent from its own
     * memory; a list or tuple of ints is copied into one.
     */
    PyObject *pins = PyList_New(0);
    if (pins == NULL)
        return NULL;
    ts_value_t *ix = NULL;
    if (PyList_Check(index_obj) || PyTuple_Check(index_obj)) {
        Py_ssize_t n = PySequence_Size(index_obj);
        int64_t len = n;
        ix = ts_tensor_alloc(TS_INT64, 1, &len);
        if (ix == NULL) {
            Py_DECREF(pins);
            return PyErr_NoMemory();
        }
        int64_t *d = ts_value_tensor(ix)->data;
        for (Py_ssize_t i = 0; i < n; i++) {
            char what[32];
            long long v = 0;
            snprintf(what, sizeof(what), "index[%zd]", i);
            PyObject *o = PySequence_GetItem(index_obj, i);
            if (o != NULL && tsp_int_arg(o, what, INT64_MIN, INT64_MAX, &v) == 0)
                d[i] = (int64_t)v;
            Py_XDECREF(o);
            if (PyErr_Occurred()) {
                ts_value_free(ix);
                Py_DECREF(pins);
                return NULL;
            }
        }
    } else {
        ix = tsp_value_from_py(index_obj, pins, 1);
        if (ix == NULL) {
            Py_DECREF(pins);
            return NULL;
        }
    }
    const ts_tensor_t *t = ts_value_tensor(ix);
    if (t == NULL || t->dtype != TS_INT64 || t->ndim != 1) {
        ts_value_free(ix);
        Py_DECREF(pins);
        return tsp_raise_msg(TS_EINVAL, "gather_rows: index must be a 1-D int64 tensor (or a "
                                        "list of ints)");
    }
    ts_client_t *c = tsp_client_enter(client);
    PyObject *r = NULL;
    if (c != NULL) {
        ts_items_t *items = NULL;
        int rc;
        Py_BEGIN_ALLOW_THREADS rc =
            ts_rows_gather(c, bin, item, key, t->data, (size_t)t->shape[0], &items);
        Py_END_ALLOW_THREADS r = rc == 0 ? rows_result(items, tt) : tsp_raise(rc);
        tsp_client_leave(client);
    }
    ts_value_free(ix);
    Py_DECREF(pins);
    return r;
}

/*
 * Whether rows_obj is raw bytes without a dtype of their own: bytes, bytearray, or a memoryview
 * of at most one dimension of bytes (format B, b or c). write_rows sends those as rows of the
 * bin's dtype; typed buffers (numpy, torch, array.array, a cast memoryview) keep theirs.
 */
static int is_raw_bytes(PyObject *obj)
{
    if (PyBytes_Check(obj) || PyByteArray_Check(obj))
        return 1;
    if (!PyMemoryView_Check(obj))
        return 0;
    const Py_buffer *b = PyMemoryView_GET_BUFFER(obj);
    const char *f = b->format != NULL ? b->format : "B";
    if (f[0] == '@' || f[0] == '=' || f[0] == '<' || f[0] == '>' || f[0] == '!')
        f++;
    return b->ndim <= 1 && b->itemsize == 1 && (f[0] == 'B' || f[0] == 'b' || f[0] == 'c') &&
           f[1] == '\0';
}

/*
 * The tensor write_rows sends for raw bytes (is_raw_bytes; their memory in view, C-contiguous):
 * whole rows of the bin's dtype and row shape, which a read of 0 rows learns from the server.
 * A new value borrowing view->buf, or NULL with an exception. The client is entered.
 */
static ts_value_t *raw_rows(ts_client_t *c, const char *bin, const Py_buffer *view)
{
    ts_items_t *probe = NULL;
    int rc;
    PyThreadState *nogil = PyEval_SaveThread();
    rc = ts_rows_read(c, bin, 0, NULL, 0, 0, &probe);
    PyEval_RestoreThread(nogil);
    if (rc != 0) {
        tsp_raise(rc);
        return NULL;
    }
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(probe, 0));
    if (t == NULL || t->ndim < 1) {
        ts_items_free(probe);
        tsp_raise_msg(TS_EPROTO, "the server's reply holds no rows");
        return NULL;
    }
    int64_t shape[TS_MAX_NDIM];
    size_t row_bytes = ts_dtype_size(t->dtype);
    for (int i = 1; i < t->ndim; i++) {
        shape[i] = t->shape[i];
        row_bytes *= (size_t)t->shape[i];
    }
    ts_dtype_t dtype = t->dtype;
    int ndim = t->ndim;
    ts_items_free(probe);
    size_t len = (size_t)view->len;
    if (row_bytes == 0 ? len != 0 : len % row_bytes != 0) {
        char msg[160];
        snprintf(msg, sizeof(msg),
                 "write_rows: %zu bytes are not whole rows of %s (%zu bytes each)", len,
                 ts_dtype_name(dtype), row_bytes);
        tsp_raise_msg(TS_EINVAL, msg);
        return NULL;
    }
    shape[0] = row_bytes == 0 ? 0 : (int64_t)(len / row_bytes);
    ts_value_t *v = ts_tensor_new(dtype, ndim, shape, len == 0 ? NULL : view->buf, TS_BORROW);
    return v != NULL ? v : (ts_value_t *)PyErr_NoMemory();
}

PyObject *tsp_client_write_rows(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"bin", "start", "rows", NULL};
    const char *bin;
    long long start = 0;
    PyObject *start_obj, *rows_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO:write_rows", names, &bin, &start_obj,
                                     &rows_obj) ||
        tsp_int_arg(start_obj, "start", INT64_MIN, INT64_MAX, &start) < 0)
        return NULL;
    tsp_send_t s = {NULL, NULL};
    Py_buffer raw;
    int is_raw = is_raw_bytes(rows_obj);
    if (is_raw) {
        if (PyObject_GetBuffer(rows_obj, &raw, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
    } else {
        if (tsp_send_init(&s, rows_obj) < 0)
            return NULL;
        if (ts_value_type(s.value) != TS_TYPE_TENSOR) {
            tsp_send_clear(&s);
            return tsp_raise_msg(TS_EINVAL, "write_rows: rows must be a tensor or a buffer");
        }
    }
    ts_client_t *c = tsp_client_enter(client);
    PyObject *r = NULL;
    if (c != NULL) {
        ts_value_t *rows = is_raw ? raw_rows(c, bin, &raw) : s.value;
        if (rows != NULL) {
            uint64_t version = 0;
            int rc;
            Py_BEGIN_ALLOW_THREADS rc = ts_rows_write(c, bin, (int64_t)start, rows, &version);
            Py_END_ALLOW_THREADS r = rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
            if (is_raw)
                ts_value_free(rows);
        }
        tsp_client_leave(client);
    }
    if (is_raw)
        PyBuffer_Release(&raw);
    else
        tsp_send_clear(&s);
    return r;
}
