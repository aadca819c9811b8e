/*
 * Shared-buffer puts for Python (same-host zero copy; docs/PYTHON.md "Same-host zero copy"):
 *   buf = client.shared({"x": (torch.float32, (1024, 1024)), "step": 7})
 *   buf["x"].copy_(...)              # a torch tensor (or numpy array) over the buffer itself
 *   client.put_shared("bin", buf)    # or append_shared: the buffer is the server's from then on
 *
 * The SharedBuffer type owns a ts_shared_t. Its tensors are handed out over Segment objects (a
 * writable buffer-protocol view of one tensor; torch.frombuffer and numpy.asarray keep the
 * Segment alive exactly as long as their tensor or array). Writing after a commit must be
 * impossible: the library withdraws the memory at a commit, so a commit is refused
 * (BufferError) while any Segment, hence any tensor over the buffer, is still alive.
 *
 * By-reference reads (get/peek with ref=True) need nothing here: they return ts_items_t like
 * ts_get, converted by the usual view machinery (python/src/client.c get_impl).
 */
#include "tsp.h"

#include <string.h>

typedef struct tsp_shared {
    PyObject_HEAD ts_shared_t *sh;
    tsp_tensor_type_t tt;
    Py_ssize_t segments; /* Segment objects alive (each holds a reference on this object) */
    int committed;       /* handed to the server: its memory is withdrawn */
    int busy;            /* a commit is running (without the GIL) */
    int closed;          /* left its with block with tensors alive: freed with the last one */
} tsp_shared;

typedef struct tsp_segment {
    PyObject_HEAD tsp_shared *owner; /* a strong reference */
    const ts_tensor_t *t;            /* inside owner's tree */
    tsp_layout layout;               /* of t */
} tsp_segment;

static PyTypeObject shared_type;
static PyTypeObject segment_type;

/* ---------------------------------------------------------------------------------------------
 * Segment: one tensor of a shared buffer, writable through the buffer protocol
 */

static int segment_getbuffer(PyObject *self, Py_buffer *b, int flags)
{
    tsp_segment *s = (tsp_segment *)self;
    if (s->owner->committed || s->owner->busy) {
        PyErr_SetString(PyExc_BufferError, "the shared buffer was committed");
        b->obj = NULL;
        return -1;
    }
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS) {
        if (tsp_layout_big_dims(&s->layout) > 1) {
            PyErr_SetString(PyExc_BufferError, "shared tensors are C-contiguous");
            b->obj = NULL;
            return -1;
        }
    }
    tsp_layout_export(&s->layout, b, self, s->t->data, 0, flags);
    return 0;
}

static PyBufferProcs segment_as_buffer = {.bf_getbuffer = segment_getbuffer};

static void segment_dealloc(PyObject *self)
{
    tsp_segment *s = (tsp_segment *)self;
    if (s->owner != NULL) {
        s->owner->segments--;
        Py_DECREF(s->owner);
    }
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject segment_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare._SharedSegment",
    .tp_basicsize = sizeof(tsp_segment),
    .tp_dealloc = segment_dealloc,
    .tp_as_buffer = &segment_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One tensor of a SharedBuffer (internal: the owner of a tensor's memory).",
};

static tsp_segment *segment_new(tsp_shared *owner, const ts_tensor_t *t)
{
    tsp_segment *s = PyObject_New(tsp_segment, &segment_type);
    if (s == NULL)
        return NULL;
    Py_INCREF(owner);
    s->owner = owner;
    owner->segments++;
    s->t = t;
    tsp_layout_init(&s->layout, t->dtype, t->ndim, t->shape);
    return s;
}

/* Cached objects for making tensors over segments (set on first use, kept for the process). */
static struct {
    PyObject *torch_frombuffer;
    PyObject *torch_empty;
    PyObject *torch_dtypes[TS_COMPLEX128 + 1]; /* torch.<name> by ts dtype */
} cache;

static int torch_ready(void)
{
    if (cache.torch_frombuffer != NULL)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    PyObject *dts[TS_COMPLEX128 + 1] = {NULL};
    int ok = 1;
    for (int d = TS_BOOL; d <= TS_COMPLEX128 && ok; d++) {
        dts[d] = PyObject_GetAttrString(torch, ts_dtype_name((ts_dtype_t)d));
        ok = dts[d] != NULL;
    }
    PyObject *fb = ok ? PyObject_GetAttrString(torch, "frombuffer") : NULL;
    PyObject *em = fb != NULL ? PyObject_GetAttrString(torch, "empty") : NULL;
    Py_DECREF(torch);
    if (em == NULL) {
        Py_XDECREF(fb);
        for (int d = 0; d <= TS_COMPLEX128; d++)
            Py_XDECREF(dts[d]);
        return -1;
    }
    memcpy(cache.torch_dtypes, dts, sizeof(dts));
    cache.torch_empty = em;
    cache.torch_frombuffer = fb;
    return 0;
}

/* A shape tuple of t. */
static PyObject *shape_tuple(const ts_tensor_t *t)
{
    PyObject *shape = PyTuple_New(t->ndim);
    for (int i = 0; shape != NULL && i < t->ndim; i++) {
        PyObject *d = PyLong_FromLongLong(t->shape[i]);
        if (d == NULL) {
            Py_CLEAR(shape);
            break;
        }
        PyTuple_SET_ITEM(shape, i, d);
    }
    return shape;
}

/* A writable tensor (torch) or array (numpy) over the buffer's tensor t. */
static PyObject *tensor_over(tsp_shared *self, const ts_tensor_t *t)
{
    if (self->tt == TSP_TENSOR_TORCH) {
        if (torch_ready() < 0)
            return NULL;
        PyObject *dt = cache.torch_dtypes[t->dtype];
        if (ts_tensor_numel(t) == 0) { /* torch.frombuffer refuses empty buffers */
            PyObject *shape = shape_tuple(t);
            if (shape == NULL)
                return NULL;
            PyObject *kw = Py_BuildValue("{sO}", "dtype", dt);
            PyObject *args = kw != NULL ? PyTuple_Pack(1, shape) : NULL;
            PyObject *r = args != NULL ? PyObject_Call(cache.torch_empty, args, kw) : NULL;
            Py_XDECREF(args);
            Py_XDECREF(kw);
            Py_DECREF(shape);
            return r;
        }
        tsp_segment *seg = segment_new(self, t);
        if (seg == NULL)
            return NULL;
        PyObject *kw = Py_BuildValue("{sO}", "dtype", dt);
        PyObject *args = kw != NULL ? PyTuple_Pack(1, (PyObject *)seg) : NULL;
        PyObject *flat = args != NULL ? PyObject_Call(cache.torch_frombuffer, args, kw) : NULL;
        Py_XDECREF(args);
        Py_XDECREF(kw);
        Py_DECREF(seg); /* the tensor keeps it */
        if (flat == NULL)
            return NULL;
        PyObject *shape = shape_tuple(t);
        PyObject *r = shape != NULL ? PyObject_CallMethod(flat, "view", "(O)", shape) : NULL;
        Py_XDECREF(shape);
        Py_DECREF(flat);
        return r;
    }
    PyObject *np_asarray, *np_bfloat16;
    if (tsp_numpy_ready(&np_asarray, &np_bfloat16) < 0)
        return NULL;
    tsp_segment *seg = segment_new(self, t);
    if (seg == NULL)
        return NULL;
    PyObject *a = PyObject_CallOneArg(np_asarray, (PyObject *)seg);
    Py_DECREF(seg);
    if (a != NULL && t->dtype == TS_BFLOAT16) {
        PyObject *v = PyObject_CallMethod(a, "view", "(O)", np_bfloat16);
        Py_DECREF(a);
        a = v;
    }
    return a;
}

/* A value of the buffer's tree as Python: tensors over the buffer, the rest copied. */
static PyObject *value_over(tsp_shared *self, const ts_value_t *v, int depth)
{
    if (depth > TS_MAX_DEPTH) {
        PyErr_SetString(PyExc_RecursionError, "shared buffer nested too deeply");
        return NULL;
    }
    switch (ts_value_type(v)) {
    case TS_TYPE_TENSOR:
        return tensor_over(self, ts_value_tensor(v));
    case TS_TYPE_MAP: {
        PyObject *d = PyDict_New();
        for (size_t i = 0; d != NULL && i < ts_value_len(v); i++) {
            PyObject *x = value_over(self, ts_map_value_at(v, i), depth + 1);
            if (x == NULL || PyDict_SetItemString(d, ts_map_key_at(v, i), x) < 0)
                Py_CLEAR(d);
            Py_XDECREF(x);
        }
        return d;
    }
    case TS_TYPE_LIST: {
        PyObject *l = PyList_New((Py_ssize_t)ts_value_len(v));
        for (size_t i = 0; l != NULL && i < ts_value_len(v); i++) {
            PyObject *x = value_over(self, ts_list_at(v, i), depth + 1);
            if (x == NULL) {
                Py_CLEAR(l);
                break;
            }
            PyList_SET_ITEM(l, (Py_ssize_t)i, x);
        }
        return l;
    }
    default:
        return tsp_value_to_py(v,
                               self->tt == TSP_TENSOR_TORCH ? TSP_TENSOR_TORCH : TSP_TENSOR_NUMPY);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Layouts: Python -> a value tree whose tensors are specs
 */

/* The ts dtype of a dtype-like object (a str name, a torch.dtype, a numpy dtype or type). */
static ts_dtype_t dtype_from_py(PyObject *obj)
{
    ts_dtype_t d = TS_DTYPE_INVALID;
    if (PyUnicode_Check(obj)) {
        const char *s = tsp_c_string(obj);
        if (s == NULL) {
            PyErr_Clear();
            return TS_DTYPE_INVALID;
        }
        return ts_dtype_from_name(s);
    }
    PyObject *str = PyObject_Str(obj);
    const char *s = str != NULL ? PyUnicode_AsUTF8(str) : NULL;
    if (s != NULL && strncmp(s, "torch.", 6) == 0 &&
        strcmp(Py_TYPE(obj)->tp_name, "torch.dtype") == 0)
        d = ts_dtype_from_name(s + 6);
    Py_XDECREF(str);
    PyErr_Clear();
    if (d != TS_DTYPE_INVALID)
        return d;
    /* Anything else is for numpy.dtype to read (numpy types, numpy dtypes, "f4", float). */
    PyObject *npm = PyImport_ImportModule("numpy");
    if (npm == NULL) {
        PyErr_Clear();
        return TS_DTYPE_INVALID;
    }
    PyObject *dt = PyObject_CallMethod(npm, "dtype", "(O)", obj);
    Py_DECREF(npm);
    if (dt == NULL) {
        PyErr_Clear();
        return TS_DTYPE_INVALID;
    }
    PyObject *name = PyObject_GetAttrString(dt, "name");
    PyObject *order = PyObject_GetAttrString(dt, "byteorder");
    const char *n = name != NULL ? PyUnicode_AsUTF8(name) : NULL;
    const char *o = order != NULL ? PyUnicode_AsUTF8(order) : NULL;
    if (n != NULL && o != NULL && strcmp(o, ">") != 0)
        d = ts_dtype_from_name(n);
    Py_XDECREF(name);
    Py_XDECREF(order);
    Py_DECREF(dt);
    PyErr_Clear();
    return d;
}

/*
 * Whether obj stands for a dtype as the first element of a (dtype, shape) pair: a str, a
 * torch.dtype, a numpy dtype, or a type (numpy's scalar types such as numpy.float32, and the
 * Python types numpy.dtype reads, such as float).
 */
static int is_dtype_like(PyObject *obj)
{
    if (PyUnicode_Check(obj) || PyType_Check(obj))
        return 1;
    if (strcmp(Py_TYPE(obj)->tp_name, "torch.dtype") == 0)
        return 1;
    /* A numpy dtype exists only once numpy was imported. */
    PyObject *name = PyUnicode_FromString("numpy");
    PyObject *np = name != NULL ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    PyObject *np_dtype = np != NULL ? PyObject_GetAttrString(np, "dtype") : NULL;
    Py_XDECREF(np);
    int r = np_dtype != NULL ? PyObject_IsInstance(obj, np_dtype) : 0;
    Py_XDECREF(np_dtype);
    PyErr_Clear();
    return r > 0;
}

/*
 * A (dtype, shape) pair of a layout: a tuple of two whose first element is dtype-like
 * (is_dtype_like). 1 and the spec, 0 when obj is not a pair (a plain value), -1 with RecordError
 * when it is one but its dtype is not one of the 12 or its shape is not a tuple or list of ints.
 */
static int spec_from_py(PyObject *obj, ts_value_t **out)
{
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != 2 ||
        !is_dtype_like(PyTuple_GET_ITEM(obj, 0)))
        return 0;
    PyObject *dtype = PyTuple_GET_ITEM(obj, 0);
    PyObject *shape = PyTuple_GET_ITEM(obj, 1);
    ts_dtype_t d = dtype_from_py(dtype);
    if (d == TS_DTYPE_INVALID) {
        PyErr_Format(tsp_state.RecordError,
                     "unsupported dtype %R in a layout's (dtype, shape) pair: bool, uint8, int8, "
                     "int16, int32, int64, float16, bfloat16, float32, float64, complex64 or "
                     "complex128",
                     dtype);
        return -1;
    }
    if (!PyTuple_Check(shape) && !PyList_Check(shape)) {
        PyErr_Format(tsp_state.RecordError,
                     "the shape of a layout's (dtype, shape) pair is a tuple or list of ints, "
                     "not %.100s",
                     Py_TYPE(shape)->tp_name);
        return -1;
    }
    Py_ssize_t nd = PySequence_Size(shape);
    if (nd > TS_MAX_NDIM) {
        PyErr_Format(tsp_state.RecordError, "a shared tensor has at most %d dimensions",
                     TS_MAX_NDIM);
        return -1;
    }
    int64_t dims[TS_MAX_NDIM];
    for (Py_ssize_t i = 0; i < nd; i++) {
        PyObject *x = PySequence_GetItem(shape, i);
        if (x != NULL && (!PyLong_Check(x) || PyBool_Check(x))) {
            PyErr_Format(tsp_state.RecordError,
                         "the shape of a layout's (dtype, shape) pair is a tuple or list of "
                         "ints, not of %.100s",
                         Py_TYPE(x)->tp_name);
            Py_DECREF(x);
            return -1;
        }
        int overflow = 0;
        long long v = x != NULL ? PyLong_AsLongLongAndOverflow(x, &overflow) : -1;
        if (v == -1 && PyErr_Occurred()) {
            Py_XDECREF(x);
            return -1;
        }
        if (overflow != 0 || v < 0) {
            PyErr_Format(tsp_state.RecordError,
                         "a shared tensor's dimensions are ints from 0 to 2**63-1, not %R", x);
            Py_DECREF(x);
            return -1;
        }
        Py_DECREF(x);
        dims[i] = v;
    }
    *out = ts_tensor_spec_new(d, (int)nd, dims);
    if (*out == NULL) {
        PyErr_SetString(tsp_state.RecordError, "a shared tensor of this shape cannot be made");
        return -1;
    }
    return 1;
}

/* A layout tree (dicts, lists, (dtype, shape) pairs, other record values) as a value. */
static ts_value_t *layout_from_py(PyObject *obj, PyObject *pins, int depth)
{
    if (depth > TS_MAX_DEPTH) {
        PyErr_Format(tsp_state.RecordError, "layout nested deeper than %d levels", TS_MAX_DEPTH);
        return NULL;
    }
    ts_value_t *spec = NULL;
    int is_spec = spec_from_py(obj, &spec);
    if (is_spec < 0)
        return NULL;
    if (is_spec)
        return spec;
    if (PyDict_Check(obj)) {
        ts_value_t *m = ts_map_new();
        if (m == NULL)
            return (ts_value_t *)PyErr_NoMemory();
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(obj, &pos, &k, &v)) {
            const char *key = PyUnicode_Check(k) ? tsp_c_string(k) : NULL;
            if (key == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetString(tsp_state.RecordError, PyUnicode_Check(k)
                                                               ? "a dict key with a NUL character"
                                                               : "layout keys are str");
                ts_value_free(m);
                return NULL;
            }
            ts_value_t *child = layout_from_py(v, pins, depth + 1);
            if (child == NULL || ts_map_set(m, key, child) != 0) {
                if (!PyErr_Occurred())
                    PyErr_NoMemory();
                ts_value_free(m);
                return NULL;
            }
        }
        return m;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        ts_value_t *l = ts_list_new();
        if (l == NULL)
            return (ts_value_t *)PyErr_NoMemory();
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            ts_value_t *child = layout_from_py(PySequence_Fast_GET_ITEM(obj, i), pins, depth + 1);
            if (child == NULL || ts_list_push(l, child) != 0) {
                if (!PyErr_Occurred())
                    PyErr_NoMemory();
                ts_value_free(l);
                return NULL;
            }
        }
        return l;
    }
    /* Any other record value; a tensor gives its dtype and shape (its data is not read). */
    return tsp_value_from_py(obj, pins, depth);
}

/* ---------------------------------------------------------------------------------------------
 * SharedBuffer
 */

static void shared_dealloc(PyObject *obj)
{
    tsp_shared *self = (tsp_shared *)obj;
    ts_shared_free(self->sh);
    Py_TYPE(obj)->tp_free(obj);
}

/* The tree, or NULL with ValueError once committed or closed. */
static const ts_value_t *shared_tree(tsp_shared *self)
{
    if (self->busy) {
        PyErr_SetString(PyExc_ValueError, "the shared buffer is being committed");
        return NULL;
    }
    const ts_value_t *v = self->sh != NULL && !self->closed ? ts_shared_value(self->sh) : NULL;
    if (v == NULL)
        PyErr_SetString(PyExc_ValueError, self->sh == NULL || self->closed
                                              ? "the shared buffer is closed"
                                              : "the shared buffer was committed: it is the "
                                                "server's now");
    return v;
}

/* One step of a key path: a str in a map, an int in a list. */
static const ts_value_t *step(const ts_value_t *v, PyObject *key)
{
    if (PyUnicode_Check(key) && ts_value_type(v) == TS_TYPE_MAP) {
        const char *k = tsp_c_string(key); /* a key with a NUL is no key of the map */
        const ts_value_t *x = k != NULL ? ts_map_get(v, k) : NULL;
        if (x == NULL && !PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, key);
        return x;
    }
    if (PyLong_Check(key) && ts_value_type(v) == TS_TYPE_LIST) {
        /* Past Py_ssize_t: clamped, and so out of range (IndexError), as for a list. */
        Py_ssize_t i = PyNumber_AsSsize_t(key, NULL);
        if (i < 0 && !PyErr_Occurred())
            i += (Py_ssize_t)ts_value_len(v);
        const ts_value_t *x = i >= 0 ? ts_list_at(v, (size_t)i) : NULL;
        if (x == NULL && !PyErr_Occurred())
            PyErr_SetString(PyExc_IndexError, "shared buffer index out of range");
        return x;
    }
    PyErr_Format(PyExc_TypeError, "a %s key cannot index this level of the shared buffer",
                 Py_TYPE(key)->tp_name);
    return NULL;
}

static PyObject *shared_getitem(PyObject *obj, PyObject *key)
{
    tsp_shared *self = (tsp_shared *)obj;
    const ts_value_t *v = shared_tree(self);
    if (v == NULL)
        return NULL;
    if (PyTuple_Check(key)) { /* a path: buf["a", "b", 0] */
        for (Py_ssize_t i = 0; v != NULL && i < PyTuple_GET_SIZE(key); i++)
            v = step(v, PyTuple_GET_ITEM(key, i));
    } else {
        v = step(v, key);
    }
    return v == NULL ? NULL : value_over(self, v, 1);
}

static Py_ssize_t shared_len(PyObject *obj)
{
    const ts_value_t *v = shared_tree((tsp_shared *)obj);
    return v == NULL ? -1 : (Py_ssize_t)ts_value_len(v);
}

static PyMappingMethods shared_as_mapping = {
    .mp_length = shared_len,
    .mp_subscript = shared_getitem,
};

static PyObject *shared_get_value(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_shared *self = (tsp_shared *)obj;
    const ts_value_t *v = shared_tree(self);
    return v == NULL ? NULL : value_over(self, v, 1);
}

static PyObject *shared_keys(PyObject *obj, PyObject *unused)
{
    (void)unused;
    const ts_value_t *v = shared_tree((tsp_shared *)obj);
    if (v == NULL)
        return NULL;
    PyObject *l = PyList_New(0);
    for (size_t i = 0; l != NULL && ts_value_type(v) == TS_TYPE_MAP && i < ts_value_len(v); i++) {
        PyObject *k = PyUnicode_FromString(ts_map_key_at(v, i));
        if (k == NULL || PyList_Append(l, k) < 0)
            Py_CLEAR(l);
        Py_XDECREF(k);
    }
    return l;
}

static PyObject *shared_get_nbytes(PyObject *obj, void *unused)
{
    (void)unused;
    tsp_shared *self = (tsp_shared *)obj;
    return PyLong_FromSize_t(ts_shared_size(self->sh));
}

static PyObject *shared_get_committed(PyObject *obj, void *unused)
{
    (void)unused;
    return PyBool_FromLong(((tsp_shared *)obj)->committed);
}

/* BufferError while tensors over the buffer are alive (the memory must not go under them). */
static int no_live_tensors(tsp_shared *self, const char *what)
{
    if (self->segments == 0)
        return 0;
    PyErr_Format(PyExc_BufferError,
                 "%zd tensor(s) over the shared buffer are still alive: delete them before %s "
                 "(the buffer's memory is withdrawn then)",
                 self->segments, what);
    return -1;
}

static PyObject *shared_close(PyObject *obj, PyObject *unused)
{
    (void)unused;
    tsp_shared *self = (tsp_shared *)obj;
    if (self->closed)
        Py_RETURN_NONE; /* a with block closed it: the memory goes with the last tensor */
    if (self->busy) {
        PyErr_SetString(PyExc_ValueError, "the shared buffer is being committed");
        return NULL;
    }
    if (no_live_tensors(self, "closing it") < 0)
        return NULL;
    ts_shared_free(self->sh);
    self->sh = NULL;
    Py_RETURN_NONE;
}

static PyObject *shared_enter(PyObject *obj, PyObject *unused)
{
    (void)unused;
    Py_INCREF(obj);
    return obj;
}

/*
 * Leaving a with block closes the buffer; when tensors over it are still alive, it is only
 * marked closed (no more tensors, no commit) and its memory goes with the buffer object, once
 * the last tensor is gone (each holds a reference): the live tensors stay valid, and an
 * exception leaving the block is not replaced by a BufferError.
 */
static PyObject *shared_exit(PyObject *obj, PyObject *args)
{
    (void)args;
    tsp_shared *self = (tsp_shared *)obj;
    if (self->segments > 0 && !self->busy) {
        self->closed = 1;
        Py_RETURN_NONE;
    }
    return shared_close(obj, NULL);
}

static PyMethodDef shared_methods[] = {
    {"keys", shared_keys, METH_NOARGS, "keys() -> list\n\nThe root map's keys."},
    {"close", shared_close, METH_NOARGS,
     "close() -> None\n\nFree the buffer (a committed item stays on the server). BufferError "
     "while tensors over it are alive; nothing once it is closed."},
    {"__enter__", shared_enter, METH_NOARGS, NULL},
    {"__exit__", shared_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef shared_getset[] = {
    {"value", shared_get_value, NULL,
     "The whole record: tensors over the buffer (writable), other values copied.", NULL},
    {"nbytes", shared_get_nbytes, NULL, "Bytes of the encoded record.", NULL},
    {"committed", shared_get_committed, NULL,
     "True once the buffer was handed to the server (put_shared/append_shared succeeded, or "
     "failed after the server sealed it): its tensors are gone.",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject shared_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare.SharedBuffer",
    .tp_basicsize = sizeof(tsp_shared),
    .tp_dealloc = shared_dealloc,
    .tp_as_mapping = &shared_as_mapping,
    .tp_methods = shared_methods,
    .tp_getset = shared_getset,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A record in shared memory, filled in place, then committed with "
              "Client.put_shared or Client.append_shared (made by Client.shared).",
};

/* ---------------------------------------------------------------------------------------------
 * Client methods
 */

PyObject *tsp_client_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames)
{
    PyObject *layout = nargs >= 1 ? args[0] : NULL;
    PyObject *tt_obj = NULL;
    Py_ssize_t nkw = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; i < nkw; i++) {
        const char *k = tsp_c_string(PyTuple_GET_ITEM(kwnames, i));
        if (k != NULL && strcmp(k, "tensor_type") == 0) {
            tt_obj = args[nargs + i];
        } else if (k != NULL && strcmp(k, "layout") == 0 && layout == NULL) {
            layout = args[nargs + i];
        } else {
            PyErr_Format(PyExc_TypeError, "shared() got an unexpected keyword argument '%s'",
                         k != NULL ? k : "?");
            return NULL;
        }
    }
    if (layout == NULL || nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "shared(layout, *, tensor_type=None) takes one layout");
        return NULL;
    }
    tsp_tensor_type_t tt;
    if (tsp_client_tensor_type_arg(tt_obj, client, &tt) < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client); /* a closed Client refuses here too */
    if (c == NULL)
        return NULL;
    tsp_client_leave(client);
    PyObject *pins = PyList_New(0);
    if (pins == NULL)
        return NULL;
    ts_value_t *v = layout_from_py(layout, pins, 1);
    if (v == NULL) {
        Py_DECREF(pins);
        return NULL;
    }
    ts_type_t root = ts_value_type(v);
    if (root != TS_TYPE_MAP && root != TS_TYPE_LIST && root != TS_TYPE_TENSOR) {
        ts_value_free(v);
        Py_DECREF(pins);
        PyErr_Format(tsp_state.RecordError,
                     "a layout's root is a dict, a list, a (dtype, shape) pair or a tensor, not "
                     "%.100s",
                     Py_TYPE(layout)->tp_name);
        return NULL;
    }
    ts_shared_t *sh = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = ts_shared_new(v, &sh);
    Py_END_ALLOW_THREADS ts_value_free(v);
    Py_DECREF(pins);
    if (rc != 0)
        return tsp_raise(rc);
    tsp_shared *self = PyObject_New(tsp_shared, &shared_type);
    if (self == NULL) {
        ts_shared_free(sh);
        return NULL;
    }
    self->sh = sh;
    self->tt = tt;
    self->segments = 0;
    self->committed = 0;
    self->busy = 0;
    self->closed = 0;
    return (PyObject *)self;
}

static PyObject *commit(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                        PyObject *kwnames, int append)
{
    const char *fn = append ? "append_shared" : "put_shared";
    if (nargs != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0)) {
        PyErr_Format(PyExc_TypeError, "%s(bin, buffer) takes two positional arguments", fn);
        return NULL;
    }
    if (!PyUnicode_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "a bin name is a str, not %s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    if (!PyObject_TypeCheck(args[1], &shared_type)) {
        PyErr_Format(PyExc_TypeError, "%s needs a SharedBuffer (Client.shared), not %s", fn,
                     Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t blen;
    const char *bin = PyUnicode_AsUTF8AndSize(args[0], &blen);
    if (bin == NULL)
        return NULL;
    if (memchr(bin, '\0', (size_t)blen) != NULL) {
        PyErr_SetString(tsp_state.InvalidArgumentError, "a bin name cannot contain NUL");
        return NULL;
    }
    tsp_shared *buf = (tsp_shared *)args[1];
    if (buf->sh == NULL || buf->closed || buf->busy) {
        PyErr_SetString(PyExc_ValueError, buf->sh == NULL || buf->closed
                                              ? "the shared buffer is closed"
                                              : "the shared buffer is being committed");
        return NULL;
    }
    if (no_live_tensors(buf, "committing the buffer") < 0)
        return NULL;
    ts_client_t *c = tsp_client_enter(client);
    if (c == NULL)
        return NULL;
    Py_INCREF(buf);
    uint64_t version = 0;
    int rc;
    /* No tensor can be made meanwhile: busy refuses it (and any other use of the buffer). */
    buf->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = append ? ts_shared_append(c, bin, buf->sh, &version)
                                       : ts_shared_put(c, bin, buf->sh, &version);
    Py_END_ALLOW_THREADS buf->busy = 0;
    buf->committed = ts_shared_value(buf->sh) == NULL;
    PyObject *r = rc == 0 ? PyLong_FromUnsignedLongLong(version) : tsp_raise(rc);
    Py_DECREF(buf);
    tsp_client_leave(client);
    return r;
}

PyObject *tsp_client_put_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames)
{
    return commit(client, args, nargs, kwnames, 0);
}

PyObject *tsp_client_append_shared(PyObject *client, PyObject *const *args, Py_ssize_t nargs,
                                   PyObject *kwnames)
{
    return commit(client, args, nargs, kwnames, 1);
}

int tsp_shm_init(PyObject *module)
{
    if (PyType_Ready(&segment_type) < 0)
        return -1;
    return tsp_add_type(module, &shared_type, "SharedBuffer");
}
