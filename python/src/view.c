/*
 * view.c: zero-copy views of received tensors.
 *
 * A received tensor is exported with ts_value_to_dlpack, which holds its own reference on the
 * receive buffer, and wrapped in a tsp_export (below) that also holds an optional tsp_owner_t
 * and counts live exports. The export goes to torch as a DLPack capsule (torch calls the
 * deleter when the last tensor over it dies, on whatever thread) or to numpy through a View
 * object (buffer protocol; the array's base chain holds the View, whose deallocation calls the
 * deleter). Nothing here needs the GIL to let go of memory.
 */
#include "tsp.h"

#include <dlpack/dlpack.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include <tensorshare/dlpack.h>

/* ---------------------------------------------------------------------------------------------
 * Owners
 */

struct tsp_owner_s {
    atomic_long refs;
    void (*release)(void *arg);
    void *arg;
};

tsp_owner_t *tsp_owner_new(void (*release)(void *arg), void *arg)
{
    tsp_owner_t *o = malloc(sizeof(*o));
    if (o == NULL)
        return NULL;
    atomic_init(&o->refs, 1);
    o->release = release;
    o->arg = arg;
    return o;
}

static void owner_ref(tsp_owner_t *o)
{
    if (o != NULL)
        atomic_fetch_add_explicit(&o->refs, 1, memory_order_relaxed);
}

void tsp_owner_unref(tsp_owner_t *o)
{
    if (o == NULL || atomic_fetch_sub_explicit(&o->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (o->release != NULL)
        o->release(o->arg);
    free(o);
}

/* ---------------------------------------------------------------------------------------------
 * Exports
 */

/* Exports alive now (tests check that views release the receive buffer). */
static atomic_long live_exports;

/* What a view holds: the DLPack tensor handed out, over the library's export. */
typedef struct tsp_export {
    DLManagedTensor mt;     /* handed to torch, or read by a View; manager_ctx = this */
    DLManagedTensor *inner; /* from ts_value_to_dlpack: holds the receive buffer */
    tsp_owner_t *owner;     /* a reference, or NULL */
    ts_dtype_t dtype;       /* the tensorshare dtype (mt's dtype may say uint8 for bool) */
} tsp_export;

/* The deleter torch (or a View) calls exactly once; any thread, no GIL needed. */
static void export_deleter(DLManagedTensor *self)
{
    tsp_export *e = self->manager_ctx;
    if (e->inner->deleter != NULL)
        e->inner->deleter(e->inner);
    tsp_owner_unref(e->owner);
    free(e);
    atomic_fetch_sub_explicit(&live_exports, 1, memory_order_relaxed);
}

/* A new export of the tensor value v, taking a reference on owner; NULL with an exception. */
static tsp_export *export_new(const ts_value_t *v, tsp_owner_t *owner)
{
    DLManagedTensor *inner;
    int rc = ts_value_to_dlpack(v, &inner);
    if (rc != 0)
        return (tsp_export *)tsp_raise_msg(rc, NULL);
    tsp_export *e = malloc(sizeof(*e));
    if (e == NULL) {
        inner->deleter(inner);
        PyErr_NoMemory();
        return NULL;
    }
    e->mt.dl_tensor = inner->dl_tensor;
    e->mt.manager_ctx = e;
    e->mt.deleter = export_deleter;
    e->inner = inner;
    e->owner = owner;
    e->dtype = ts_value_tensor(v)->dtype;
    owner_ref(owner);
    atomic_fetch_add_explicit(&live_exports, 1, memory_order_relaxed);
    return e;
}

long tsp_live_exports(void);
long tsp_live_exports(void)
{
    return atomic_load_explicit(&live_exports, memory_order_relaxed);
}

/* ---------------------------------------------------------------------------------------------
 * The View type: a read-only buffer over one export, for numpy
 */

typedef struct tsp_view {
    PyObject_HEAD tsp_export *e;
    tsp_layout layout; /* of e's tensor, with e's dtype */
} tsp_view;

/*
 * The PEP 3118 format of a dtype (bfloat16 as its raw 16 bits, which tsp_tensor_to_py and shared
 * buffers then view as the bfloat16 dtype).
 */
static const char *dtype_format(ts_dtype_t d)
{
    switch (d) {
    case TS_BOOL:
        return "?";
    case TS_UINT8:
        return "B";
    case TS_INT8:
        return "b";
    case TS_INT16:
        return "h";
    case TS_INT32:
        return "i";
    case TS_INT64:
        return "q";
    case TS_FLOAT16:
        return "e";
    case TS_BFLOAT16:
        return "H";
    case TS_FLOAT32:
        return "f";
    case TS_FLOAT64:
        return "d";
    case TS_COMPLEX64:
        return "Zf";
    case TS_COMPLEX128:
        return "Zd";
    default:
        return "B";
    }
}

void tsp_layout_init(tsp_layout *l, ts_dtype_t dtype, int ndim, const int64_t *shape)
{
    l->dtype = dtype;
    l->ndim = ndim;
    l->itemsize = (Py_ssize_t)ts_dtype_size(dtype);
    /* Unsigned: a dimension of 0 makes any product valid (see ts_tensor_numel). */
    size_t stride = (size_t)l->itemsize;
    for (int i = ndim - 1; i >= 0; i--) {
        l->shape[i] = (Py_ssize_t)shape[i];
        l->strides[i] = (Py_ssize_t)stride;
        stride *= (size_t)shape[i];
    }
    l->len = (Py_ssize_t)stride;
}

int tsp_layout_big_dims(const tsp_layout *l)
{
    int big = 0;
    for (int i = 0; i < l->ndim; i++)
        big += l->shape[i] > 1;
    return big;
}

void tsp_layout_export(const tsp_layout *l, Py_buffer *b, PyObject *obj, void *buf, int readonly,
                       int flags)
{
    b->buf = buf;
    b->obj = obj;
    Py_INCREF(obj);
    b->len = l->len;
    b->readonly = readonly;
    b->itemsize = l->itemsize;
    b->format = (flags & PyBUF_FORMAT) ? (char *)dtype_format(l->dtype) : NULL;
    b->ndim = l->ndim;
    /* The shape and strides arrays live in l, inside obj, which b keeps alive. */
    b->shape = (flags & PyBUF_ND) == PyBUF_ND ? (Py_ssize_t *)l->shape : NULL;
    b->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? (Py_ssize_t *)l->strides : NULL;
    b->suboffsets = NULL;
    b->internal = NULL;
}

static int view_getbuffer(PyObject *self, Py_buffer *b, int flags)
{
    tsp_view *v = (tsp_view *)self;
    if ((flags & PyBUF_WRITABLE) == PyBUF_WRITABLE) {
        PyErr_SetString(PyExc_BufferError, "received tensors are read-only");
        b->obj = NULL;
        return -1;
    }
    const DLTensor *d = &v->e->mt.dl_tensor;
    if ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS) {
        /*
         * The memory is C-ordered: it is Fortran-ordered too only with at most one dimension
         * > 1, or with no element at all.
         */
        if (tsp_layout_big_dims(&v->layout) > 1 && v->layout.len > 0) {
            PyErr_SetString(PyExc_BufferError,
                            "received tensors are C-contiguous, not Fortran-contiguous");
            b->obj = NULL;
            return -1;
        }
    }
    tsp_layout_export(&v->layout, b, self, (char *)d->data + d->byte_offset, 1, flags);
    return 0;
}

static PyBufferProcs view_as_buffer = {
    .bf_getbuffer = view_getbuffer,
    .bf_releasebuffer = NULL,
};

static void view_dealloc(PyObject *self)
{
    tsp_view *v = (tsp_view *)self;
    if (v->e != NULL)
        v->e->mt.deleter(&v->e->mt);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject view_type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorshare._tensorshare.View",
    .tp_basicsize = sizeof(tsp_view),
    .tp_dealloc = view_dealloc,
    .tp_as_buffer = &view_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Read-only memory of one received tensor (the base of received numpy arrays).",
};

/* A View owning e (consumed, also on failure). */
static PyObject *view_new(tsp_export *e)
{
    tsp_view *v = PyObject_New(tsp_view, &view_type);
    if (v == NULL) {
        e->mt.deleter(&e->mt);
        return NULL;
    }
    v->e = e;
    const DLTensor *d = &e->mt.dl_tensor;
    tsp_layout_init(&v->layout, e->dtype, d->ndim, d->shape);
    return (PyObject *)v;
}

/* ---------------------------------------------------------------------------------------------
 * Tensors to Python
 */

/* Cached Python objects for making tensors (set on first use, kept for the process). */
static struct {
    PyObject *torch_from_dlpack; /* torch._C._from_dlpack */
    PyObject *torch_bool;        /* torch.bool */
    PyObject *np_asarray;        /* numpy.asarray */
    PyObject *np_bfloat16;       /* numpy.dtype([("bfloat16", "<u2")]) */
} cache;

static int torch_ready(void)
{
    if (cache.torch_from_dlpack != NULL)
        return 0;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL)
        return -1;
    PyObject *c = PyObject_GetAttrString(torch, "_C");
    PyObject *f = c != NULL ? PyObject_GetAttrString(c, "_from_dlpack") : NULL;
    PyObject *b = PyObject_GetAttrString(torch, "bool");
    Py_XDECREF(c);
    Py_DECREF(torch);
    if (f == NULL || b == NULL) {
        Py_XDECREF(f);
        Py_XDECREF(b);
        return -1;
    }
    cache.torch_bool = b;
    cache.torch_from_dlpack = f;
    return 0;
}

static int numpy_ready(void)
{
    if (cache.np_asarray != NULL)
        return 0;
    PyObject *np = PyImport_ImportModule("numpy");
    if (np == NULL)
        return -1;
    PyObject *asarray = PyObject_GetAttrString(np, "asarray");
    PyObject *bf = PyObject_GetAttrString(tsp_state.module, "numpy_bfloat16");
    if (bf == NULL) {
        PyErr_Clear();
        bf = PyObject_CallMethod(np, "dtype", "([(ss)])", "bfloat16", "<u2");
    }
    Py_DECREF(np);
    if (asarray == NULL || bf == NULL) {
        Py_XDECREF(asarray);
        Py_XDECREF(bf);
        return -1;
    }
    cache.np_bfloat16 = bf;
    cache.np_asarray = asarray;
    return 0;
}

int tsp_numpy_ready(PyObject **asarray_out, PyObject **bfloat16_out)
{
    if (numpy_ready() < 0)
        return -1;
    if (asarray_out != NULL)
        *asarray_out = cache.np_asarray;
    if (bfloat16_out != NULL)
        *bfloat16_out = cache.np_bfloat16;
    return 0;
}

/* Runs when a capsule dies: torch renamed it if it took the tensor, else the deleter is ours. */
static void capsule_destructor(PyObject *capsule)
{
    if (!PyCapsule_IsValid(capsule, "dltensor"))
        return;
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
    if (mt != NULL && mt->deleter != NULL)
        mt->deleter(mt);
}

static PyObject *export_to_torch(tsp_export *e)
{
    if (torch_ready() < 0) {
        e->mt.deleter(&e->mt);
        return NULL;
    }
    int is_bool = e->dtype == TS_BOOL;
    if (is_bool) {
        /* torch 1.13 imports no bool through DLPack: take the bytes as uint8, then view them. */
        e->mt.dl_tensor.dtype.code = kDLUInt;
        e->mt.dl_tensor.dtype.bits = 8;
        e->mt.dl_tensor.dtype.lanes = 1;
    }
    PyObject *capsule = PyCapsule_New(&e->mt, "dltensor", capsule_destructor);
    if (capsule == NULL) {
        e->mt.deleter(&e->mt);
        return NULL;
    }
    PyObject *t = PyObject_CallOneArg(cache.torch_from_dlpack, capsule);
    Py_DECREF(capsule);
    if (t == NULL || !is_bool)
        return t;
    PyObject *b = PyObject_CallMethod(t, "view", "O", cache.torch_bool);
    Py_DECREF(t);
    return b;
}

static PyObject *export_to_numpy(tsp_export *e)
{
    if (numpy_ready() < 0) {
        e->mt.deleter(&e->mt);
        return NULL;
    }
    int is_bf16 = e->dtype == TS_BFLOAT16;
    PyObject *view = view_new(e);
    if (view == NULL)
        return NULL;
    PyObject *a = PyObject_CallOneArg(cache.np_asarray, view);
    Py_DECREF(view);
    if (a == NULL || !is_bf16)
        return a;
    PyObject *b = PyObject_CallMethod(a, "view", "O", cache.np_bfloat16);
    Py_DECREF(a);
    return b;
}

int tsp_tensor_type_ready(tsp_tensor_type_t tt)
{
    if (tt == TSP_TENSOR_DEFAULT && (tt = tsp_tensor_type_default()) == TSP_TENSOR_DEFAULT)
        return -1;
    return tt == TSP_TENSOR_NUMPY ? numpy_ready() : torch_ready();
}

PyObject *tsp_tensor_to_py(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner);
PyObject *tsp_tensor_to_py(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner)
{
    tsp_export *e = export_new(v, owner);
    if (e == NULL)
        return NULL;
    return tt == TSP_TENSOR_NUMPY ? export_to_numpy(e) : export_to_torch(e);
}

static PyObject *mod_live_views(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return PyLong_FromLong(tsp_live_exports());
}

static PyMethodDef view_methods[] = {
    {"_live_views", mod_live_views, METH_NOARGS,
     "_live_views() -> int: received tensors whose memory is still held (for tests)."},
    {NULL, NULL, 0, NULL},
};

int tsp_view_type_init(PyObject *module);
int tsp_view_type_init(PyObject *module)
{
    if (PyType_Ready(&view_type) < 0)
        return -1;
    tsp_state.ViewType = &view_type;
    return PyModule_AddFunctions(module, view_methods);
}
