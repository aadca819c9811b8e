/*
 * The Client's parameter-server methods (include/tensorshare/ps.h; docs/PS.md): ps_create,
 * ps_push, ps_pull, emb_create, emb_pull and emb_push. Tensors arrive as objects with the
 * buffer protocol (a numpy array) or as CPU torch tensors (viewed through numpy: the same
 * memory), float32 and C-contiguous, and are read or written in place, never copied.
 * Each call is one blocking call of the C client made without the GIL; a stale gradient becomes
 * StaleGradientError carrying the parameter's current version.
 */
#include "tsp.h"

#include <string.h>

#include "tensorshare/ps.h"

/*
 * A torch tensor as a numpy array over the same memory (tensor.detach().numpy(): no copy), for
 * the buffer protocol torch tensors lack; NULL without an exception for anything else, or for a
 * tensor numpy cannot view (not on the CPU).
 */
static PyObject *torch_as_numpy(PyObject *obj)
{
    PyObject *mod = PyObject_GetAttrString((PyObject *)Py_TYPE(obj), "__module__");
    const char *m = mod != NULL && PyUnicode_Check(mod) ? PyUnicode_AsUTF8(mod) : NULL;
    int is_torch = m != NULL && strncmp(m, "torch", 5) == 0;
    Py_XDECREF(mod);
    PyObject *arr = NULL;
    if (is_torch) {
        PyObject *d = PyObject_CallMethod(obj, "detach", NULL);
        arr = d != NULL ? PyObject_CallMethod(d, "numpy", NULL) : NULL;
        Py_XDECREF(d);
    }
    PyErr_Clear();
    return arr;
}

/*
 * Get a C-contiguous buffer of obj (an object with the buffer protocol, such as a numpy array,
 * or a CPU torch tensor) whose items are format fmt ("f" or "q"). -1 with an error.
 */
static int ps_buffer(PyObject *obj, const char *what, const char *fmt, size_t itemsize,
                     int writable, Py_buffer *view)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        PyObject *arr = torch_as_numpy(obj);
        int rc = arr != NULL ? PyObject_GetBuffer(arr, view, flags) : -1;
        Py_XDECREF(arr); /* on success view->obj holds it */
        if (rc < 0) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError,
                         "%s must be a C-contiguous%s %s CPU tensor (numpy, torch or another "
                         "buffer)",
                         what, writable ? " writable" : "", fmt[0] == 'f' ? "float32" : "int64");
            return -1;
        }
    }
    const char *f = view->format != NULL ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@')
        f++;
    /* "l" is int64 too on the LP64 platforms the package is built for. */
    int ok = (size_t)view->itemsize == itemsize &&
             (strcmp(f, fmt) == 0 || (fmt[0] == 'q' && strcmp(f, "l") == 0));
    if (!ok) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "%s must be %s", what, fmt[0] == 'f' ? "float32" : "int64");
        return -1;
    }
    return 0;
}

PyObject *tsp_client_ps_create(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "optimizer", "mode",      "lr",           "beta1", "beta2",
                            "eps",  "sync_k",    "tolerance", "lr_staleness", "keep",  NULL};
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    const char *name;
    PyObject *optimizer_obj = NULL, *mode_obj = NULL, *sync_k_obj = NULL, *tolerance_obj = NULL;
    int lr_staleness = 0, keep = 0;
    unsigned long long optimizer = o.optimizer, mode = o.mode, sync_k = o.sync_k,
                       tolerance = o.tolerance;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|OOddddOOpp:ps_create", names, &name,
                                     &optimizer_obj, &mode_obj, &o.lr, &o.beta1, &o.beta2, &o.eps,
                                     &sync_k_obj, &tolerance_obj, &lr_staleness, &keep) ||
        tsp_uint_arg_einval(optimizer_obj, "optimizer", TS_PS_SUM, TS_PS_ADAM, &optimizer) < 0 ||
        tsp_uint_arg_einval(mode_obj, "mode", TS_PS_ASYNC, TS_PS_SYNC, &mode) < 0 ||
        tsp_uint_arg(sync_k_obj, "sync_k", 0, UINT32_MAX, &sync_k) < 0 ||
        tsp_uint_arg(tolerance_obj, "tolerance", 0, UINT32_MAX, &tolerance) < 0)
        return NULL;
    o.optimizer = (ts_ps_optimizer_t)optimizer;
    o.mode = (ts_ps_mode_t)mode;
    o.sync_k = (uint32_t)sync_k;
    o.tolerance = (uint32_t)tolerance;
    o.lr_staleness = lr_staleness;
    o.keep = keep;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_ps_create(c, name, &o, &version);
    Py_END_ALLOW_THREADS PyObject *r =
        rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_ps_push(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "grad", "base_version", "scale", NULL};
    const char *name;
    PyObject *grad_obj, *base_obj = NULL;
    unsigned long long base = 0;
    double scale = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|Od:ps_push", names, &name, &grad_obj, &base_obj,
                                     &scale) ||
        tsp_uint_arg(base_obj, "base_version", 0, UINT64_MAX, &base) < 0)
        return NULL;
    Py_buffer view;
    if (ps_buffer(grad_obj, "grad", "f", sizeof(float), 0, &view) < 0)
        return NULL;
    ts_tensor_t t;
    memset(&t, 0, sizeof(t));
    int ndim = view.ndim;
    if (ndim > TS_MAX_NDIM) {
        PyBuffer_Release(&view);
        return tsp_raise_msg(TS_EINVAL, "grad has too many dimensions");
    }
    for (int i = 0; i < ndim; i++)
        t.shape[i] = (int64_t)view.shape[i];
    t.dtype = TS_FLOAT32;
    t.ndim = ndim;
    t.data = view.buf;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_ps_push(c, name, &t, (uint64_t)base, scale, &version);
    Py_END_ALLOW_THREADS PyBuffer_Release(&view);
    PyObject *r;
    if (rc == 0)
        r = PyLong_FromUnsignedLongLong(version);
    else if (rc == TS_ESTALE)
        r = tsp_raise_versioned(rc, version);
    else
        r = tsp_raise(rc);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_ps_pull(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "if_newer_than", "tensor_type", NULL};
    const char *name;
    unsigned long long newer = 0;
    PyObject *newer_obj = NULL, *tt_obj = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|O$O:ps_pull", names, &name, &newer_obj,
                                     &tt_obj) ||
        tsp_uint_arg(newer_obj, "if_newer_than", 0, UINT64_MAX, &newer) < 0)
        return NULL;
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    ts_items_t *items = NULL;
    uint64_t version = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_ps_pull(c, name, (uint64_t)newer, &items, &version);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    if (rc != 0) {
        r = tsp_raise(rc);
    } else if (items == NULL) {
        Py_INCREF(Py_None);
        r = Py_None;
    } else {
        /* (version, value): the bin's one item. */
        PyObject *list = tsp_items_to_py(items, tt);
        if (list != NULL && PyList_Check(list) && PyList_GET_SIZE(list) >= 1)
            r = Py_BuildValue("(KO)", (unsigned long long)version, PyList_GET_ITEM(list, 0));
        else if (list != NULL)
            PyErr_SetString(PyExc_RuntimeError, "ps_pull: the bin holds no item");
        Py_XDECREF(list);
    }
    ts_items_free(items);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_emb_create(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "dim",   "optimizer", "init", "seed",       "num_ids",
                            "lr",   "beta1", "beta2",     "eps",  "init_scale", NULL};
    const char *name;
    PyObject *dim_obj, *optimizer_obj = NULL, *init_obj = NULL, *seed_obj = NULL,
                       *num_ids_obj = NULL;
    /* The defaults do not depend on dim (ts_emb_options_init), so fill them before parsing. */
    ts_emb_options_t o;
    ts_emb_options_init(&o, 1);
    unsigned long long dim = 0, optimizer = o.optimizer, init = o.init, seed = o.seed,
                       num_ids = o.num_ids;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sO|OOOOddddd:emb_create", names, &name, &dim_obj,
                                     &optimizer_obj, &init_obj, &seed_obj, &num_ids_obj, &o.lr,
                                     &o.beta1, &o.beta2, &o.eps, &o.init_scale) ||
        tsp_uint_arg(dim_obj, "dim", 0, UINT32_MAX, &dim) < 0 ||
        tsp_uint_arg_einval(optimizer_obj, "optimizer", TS_PS_SUM, TS_PS_ADAM, &optimizer) < 0 ||
        tsp_uint_arg_einval(init_obj, "init", TS_PS_INIT_ZEROS, TS_PS_INIT_NORMAL, &init) < 0 ||
        tsp_uint_arg(seed_obj, "seed", 0, UINT64_MAX, &seed) < 0 ||
        tsp_uint_arg(num_ids_obj, "num_ids", 0, UINT64_MAX, &num_ids) < 0)
        return NULL;
    o.dim = (uint32_t)dim;
    o.optimizer = (ts_ps_optimizer_t)optimizer;
    o.init = (ts_ps_init_t)init;
    o.seed = seed;
    o.num_ids = num_ids;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_emb_create(c, name, &o);
    Py_END_ALLOW_THREADS PyObject *r = NULL;
    /* Py_NewRef is 3.10's; the package builds for 3.9 too. */
    if (rc == 0) {
        Py_INCREF(Py_None);
        r = Py_None;
    } else {
        tsp_raise(rc);
    }
    tsp_client_leave(client);
    return r;
}

/* The ids buffer (int64, one dimension) and a float32 rows buffer of len(ids) x dim. */
static int emb_buffers(PyObject *ids_obj, PyObject *rows_obj, int writable, Py_buffer *ids,
                       Py_buffer *rows, size_t *n, uint32_t *dim)
{
    if (ps_buffer(ids_obj, "ids", "q", sizeof(int64_t), 0, ids) < 0)
        return -1;
    if (ps_buffer(rows_obj, writable ? "out" : "grads", "f", sizeof(float), writable, rows) < 0) {
        PyBuffer_Release(ids);
        return -1;
    }
    *n = (size_t)(ids->len / (Py_ssize_t)sizeof(int64_t));
    if (ids->ndim != 1 || rows->ndim != 2 || (size_t)rows->shape[0] != *n || rows->shape[1] < 1 ||
        rows->shape[1] > 65536) {
        PyBuffer_Release(ids);
        PyBuffer_Release(rows);
        tsp_raise_msg(TS_EINVAL, "ids must be [n] int64 and rows [n, dim] float32");
        return -1;
    }
    *dim = (uint32_t)rows->shape[1];
    return 0;
}

PyObject *tsp_client_emb_pull(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "ids", "out", NULL};
    const char *name;
    PyObject *ids_obj, *out_obj;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO:emb_pull", names, &name, &ids_obj, &out_obj))
        return NULL;
    Py_buffer ids, out;
    size_t n;
    uint32_t dim;
    if (emb_buffers(ids_obj, out_obj, 1, &ids, &out, &n, &dim) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    PyObject *r = NULL;
    if (c != NULL) {
        uint64_t version = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = ts_emb_pull(c, name, ids.buf, n, dim, out.buf, &version);
        Py_END_ALLOW_THREADS r = rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
        tsp_client_leave(client);
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&out);
    return r;
}

/* Shards a cluster handle may have (docs/CLUSTER.md): the vector's largest size. */
#define TSP_EMB_MAX_SHARDS 1024

PyObject *tsp_client_emb_versions(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", NULL};
    const char *name;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s:emb_versions", names, &name))
        return NULL;
    uint64_t *v = PyMem_Malloc(TSP_EMB_MAX_SHARDS * sizeof(*v));
    if (v == NULL)
        return PyErr_NoMemory();
    ts_client_t *c = tsp_client_enter(client);
    PyObject *r = NULL;
    if (c != NULL) {
        size_t n = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS rc = ts_emb_versions(c, name, v, TSP_EMB_MAX_SHARDS, &n);
        Py_END_ALLOW_THREADS tsp_client_leave(client);
        if (rc != 0) {
            r = tsp_raise(rc);
        } else {
            if (n > TSP_EMB_MAX_SHARDS)
                n = TSP_EMB_MAX_SHARDS;
            r = PyList_New((Py_ssize_t)n);
            for (size_t i = 0; r != NULL && i < n; i++) {
                PyObject *x = PyLong_FromUnsignedLongLong(v[i]);
                if (x == NULL) {
                    Py_CLEAR(r);
                    break;
                }
                PyList_SET_ITEM(r, (Py_ssize_t)i, x);
            }
        }
    }
    PyMem_Free(v);
    return r;
}

PyObject *tsp_client_emb_push(PyObject *client, PyObject *args, PyObject *kw)
{
    static char *names[] = {"name", "ids", "grads", "scale", NULL};
    const char *name;
    PyObject *ids_obj, *grads_obj;
    double scale = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOO|d:emb_push", names, &name, &ids_obj, &grads_obj,
                                     &scale))
        return NULL;
    Py_buffer ids, grads;
    size_t n;
    uint32_t dim;
    if (emb_buffers(ids_obj, grads_obj, 0, &ids, &grads, &n, &dim) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    PyObject *r = NULL;
    if (c != NULL) {
        uint64_t version = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS rc =
            ts_emb_push(c, name, ids.buf, n, dim, grads.buf, scale, &version);
        Py_END_ALLOW_THREADS r = rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
        tsp_client_leave(client);
    }
    PyBuffer_Release(&ids);
    PyBuffer_Release(&grads);
    return r;
}
