/*
 * convert.c: Python objects to records (sending) and records to Python objects (receiving).
 *
 * Sending borrows tensor memory: torch tensors and __dlpack__ objects through their DLPack
 * export, buffer-protocol objects (numpy arrays) through a memoryview; the exporting object is
 * pinned in tsp_send_t.pins until the send is done. Receiving builds views (view.c).
 */
#include "tsp.h"

#include <dlpack/dlpack.h>
#include <stdarg.h>
#include <string.h>

PyObject *tsp_tensor_to_py(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner);

/* Python objects the conversions use, looked up once (kept for the process). */
static struct {
    PyTypeObject *torch_tensor; /* torch.Tensor, once torch has been imported by anyone */
    PyObject *torch_to_dlpack;  /* torch._C._to_dlpack */
    PyObject *torch_bool;       /* torch.bool */
    PyObject *torch_uint8;      /* torch.uint8 */
    PyObject *np_contiguous;    /* numpy.ascontiguousarray, once numpy has been imported */
    PyTypeObject *np_generic;   /* numpy.generic (numpy scalars), once numpy has been imported */
    int torch_resolve;          /* torch.Tensor has resolve_conj and resolve_neg (1.10+) */
    PyObject *s_dtype, *s_view, *s_contiguous, *s_dlpack, *s_dlpack_device; /* names */
    PyObject *s_resolve_conj, *s_resolve_neg, *s_layout, *s_device;         /* names */
} cv;

/* Raise RecordError (EBADRECORD, found before sending) with a formatted message; returns NULL. */
static void *record_error(const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    PyOS_vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    PyObject *exc = tsp_exception_make(tsp_state.RecordError, TS_EBADRECORD, msg);
    if (exc != NULL) {
        PyErr_SetObject(tsp_state.RecordError, exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/*
 * Turn the exception an exporter raised while the value obj was converted (torch or numpy
 * refusing a tensor they cannot export: sparse, meta, quantized, datetime64; a __dlpack__ object
 * failing) into a RecordError naming obj's type, with the original as its __cause__: a value
 * that cannot be sent is a RecordError whoever found it. MemoryError, RecordError and what is
 * not an Exception (KeyboardInterrupt) pass through unchanged. Returns NULL.
 */
static void *export_error(PyObject *obj)
{
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    if (type == NULL)
        return NULL;
    if (!PyErr_GivenExceptionMatches(type, PyExc_Exception) ||
        PyErr_GivenExceptionMatches(type, PyExc_MemoryError) ||
        PyErr_GivenExceptionMatches(type, tsp_state.RecordError)) {
        PyErr_Restore(type, val, tb);
        return NULL;
    }
    PyErr_NormalizeException(&type, &val, &tb);
    if (tb != NULL)
        PyException_SetTraceback(val, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    /* A torch tensor's layout and device say most about why (torch's messages are long). */
    PyObject *detail = NULL;
    if (cv.torch_tensor != NULL && PyObject_TypeCheck(obj, cv.torch_tensor)) {
        PyObject *layout = PyObject_GetAttr(obj, cv.s_layout);
        PyObject *device = PyObject_GetAttr(obj, cv.s_device);
        if (layout != NULL && device != NULL)
            detail = PyUnicode_FromFormat(" (layout %S, device %S)", layout, device);
        Py_XDECREF(layout);
        Py_XDECREF(device);
        if (detail == NULL)
            PyErr_Clear();
    }
    PyObject *msg = val != NULL ? PyObject_Str(val) : NULL;
    const char *m = msg != NULL ? PyUnicode_AsUTF8(msg) : NULL;
    const char *d = detail != NULL ? PyUnicode_AsUTF8(detail) : NULL;
    if (m == NULL || d == NULL)
        PyErr_Clear();
    /* The first line of the exporter's message: the whole of it stays in __cause__. */
    int first_line = m != NULL ? (int)strcspn(m, "\n") : 0;
    record_error("a %s%s cannot be sent: %.*s", Py_TYPE(obj)->tp_name, d != NULL ? d : "",
                 first_line, m != NULL ? m : "");
    Py_XDECREF(msg);
    Py_XDECREF(detail);
    PyObject *rt, *rv, *rtb;
    PyErr_Fetch(&rt, &rv, &rtb);
    PyErr_NormalizeException(&rt, &rv, &rtb);
    if (rv != NULL && val != NULL)
        PyException_SetCause(rv, val); /* steals val */
    else
        Py_XDECREF(val);
    PyErr_Restore(rt, rv, rtb);
    return NULL;
}

/*
 * Whether obj is a numpy scalar (an instance of numpy.generic), looked for only once numpy is
 * imported (by the program: sending never imports it).
 */
static int is_numpy_scalar(PyObject *obj)
{
    if (cv.np_generic == NULL) {
        PyObject *np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy"); /* borrowed */
        if (np == NULL)
            return 0;
        PyObject *g = PyObject_GetAttrString(np, "generic");
        if (g == NULL || !PyType_Check(g)) {
            /* A half-imported numpy: try again next time. */
            PyErr_Clear();
            Py_XDECREF(g);
            return 0;
        }
        cv.np_generic = (PyTypeObject *)g;
    }
    return PyObject_TypeCheck(obj, cv.np_generic);
}

/* Caches torch's objects once torch is imported (by the program: sending never imports it). */
static void torch_lookup(void)
{
    if (cv.torch_tensor != NULL)
        return;
    PyObject *mods = PyImport_GetModuleDict();
    PyObject *torch = PyDict_GetItemString(mods, "torch"); /* borrowed */
    if (torch == NULL)
        return;
    PyObject *tensor = PyObject_GetAttrString(torch, "Tensor");
    PyObject *c = PyObject_GetAttrString(torch, "_C");
    PyObject *to = c != NULL ? PyObject_GetAttrString(c, "_to_dlpack") : NULL;
    PyObject *b = PyObject_GetAttrString(torch, "bool");
    PyObject *u8 = PyObject_GetAttrString(torch, "uint8");
    Py_XDECREF(c);
    if (tensor == NULL || to == NULL || b == NULL || u8 == NULL || !PyType_Check(tensor)) {
        /* A half-imported torch: try again next time. */
        PyErr_Clear();
        Py_XDECREF(tensor);
        Py_XDECREF(to);
        Py_XDECREF(b);
        Py_XDECREF(u8);
        return;
    }
    cv.torch_resolve =
        PyObject_HasAttr(tensor, cv.s_resolve_conj) && PyObject_HasAttr(tensor, cv.s_resolve_neg);
    cv.torch_to_dlpack = to;
    cv.torch_bool = b;
    cv.torch_uint8 = u8;
    cv.torch_tensor = (PyTypeObject *)tensor;
}

static PyObject *numpy_contiguous(void)
{
    if (cv.np_contiguous == NULL) {
        PyObject *np = PyDict_GetItemString(PyImport_GetModuleDict(), "numpy");
        if (np != NULL)
            cv.np_contiguous = PyObject_GetAttrString(np, "ascontiguousarray");
        if (cv.np_contiguous == NULL)
            PyErr_Clear();
    }
    return cv.np_contiguous;
}

/* ---------------------------------------------------------------------------------------------
 * Tensors from DLPack (torch, __dlpack__ objects)
 */

static ts_dtype_t dtype_from_dl(DLDataType d)
{
    if (d.lanes != 1)
        return TS_DTYPE_INVALID;
    switch (d.code) {
    case kDLInt:
        return d.bits == 8    ? TS_INT8
               : d.bits == 16 ? TS_INT16
               : d.bits == 32 ? TS_INT32
               : d.bits == 64 ? TS_INT64
                              : TS_DTYPE_INVALID;
    case kDLUInt:
        return d.bits == 8 ? TS_UINT8 : TS_DTYPE_INVALID;
    case kDLFloat:
        return d.bits == 16   ? TS_FLOAT16
               : d.bits == 32 ? TS_FLOAT32
               : d.bits == 64 ? TS_FLOAT64
                              : TS_DTYPE_INVALID;
    case kDLBfloat:
        return d.bits == 16 ? TS_BFLOAT16 : TS_DTYPE_INVALID;
    case kDLComplex:
        return d.bits == 64 ? TS_COMPLEX64 : d.bits == 128 ? TS_COMPLEX128 : TS_DTYPE_INVALID;
    case 6: /* kDLBool in DLPack 0.8 and later */
        return d.bits == 8 ? TS_BOOL : TS_DTYPE_INVALID;
    default:
        return TS_DTYPE_INVALID;
    }
}

/*
 * Whether a DLPack tensor is dense and row-major (size-1 dimensions may have any stride). A
 * tensor without elements has no memory to lay out: torch exports such tensors with made-up
 * strides (and its .contiguous() keeps them), so they count as compact whatever their strides.
 */
static int dl_compact(const DLTensor *d)
{
    if (d->strides == NULL)
        return 1;
    for (int i = 0; i < d->ndim; i++)
        if (d->shape[i] == 0)
            return 1;
    int64_t expect = 1;
    for (int i = d->ndim - 1; i >= 0; i--) {
        if (d->shape[i] != 1 && d->strides[i] != expect)
            return 0;
        expect *= d->shape[i];
    }
    return 1;
}

/*
 * A tensor value over the DLPack capsule's memory; the capsule is appended to pins (not
 * consumed: its destructor calls the deleter). is_bool: the capsule holds a bool tensor's bytes
 * as uint8. *retry is set (and NULL returned without an exception) when the tensor is not
 * compact and the caller should make it contiguous first.
 */
static ts_value_t *tensor_from_capsule(PyObject *capsule, int is_bool, PyObject *pins, int *retry)
{
    DLManagedTensor *mt = PyCapsule_GetPointer(capsule, "dltensor");
    if (mt == NULL)
        return NULL;
    const DLTensor *d = &mt->dl_tensor;
    if (d->device.device_type != kDLCPU && d->device.device_type != kDLCUDAHost)
        return record_error("tensors on a device (DLPack device type %d) are not copied to "
                            "the host implicitly: call .cpu() first",
                            (int)d->device.device_type);
    ts_dtype_t dtype = is_bool ? TS_BOOL : dtype_from_dl(d->dtype);
    if (dtype == TS_DTYPE_INVALID)
        return record_error("unsupported tensor dtype (DLPack code %d, %d bits, %d lanes): "
                            "tensorshare has bool, uint8, int8-64, float16, bfloat16, "
                            "float32/64, complex64/128",
                            (int)d->dtype.code, (int)d->dtype.bits, (int)d->dtype.lanes);
    if (d->ndim < 0 || d->ndim > TS_MAX_NDIM)
        return record_error("a tensor of %d dimensions: at most %d", (int)d->ndim, TS_MAX_NDIM);
    if (!dl_compact(d)) {
        *retry = 1;
        return NULL;
    }
    const char *data = d->data == NULL ? NULL : (const char *)d->data + d->byte_offset;
    ts_value_t *v = ts_tensor_new(dtype, d->ndim, d->shape, data, TS_BORROW);
    if (v == NULL)
        return record_error("the tensor was refused (shape too large?)");
    if (PyList_Append(pins, capsule) < 0) {
        ts_value_free(v);
        return NULL;
    }
    return v;
}

/* A torch.Tensor (or subclass) as a tensor value over its memory. */
static ts_value_t *tensor_from_torch(PyObject *orig, PyObject *pins)
{
    PyObject *obj = orig;
    Py_INCREF(obj);
    if (cv.torch_resolve) {
        /*
         * torch keeps .conj() of a complex tensor, and the negation of the imaginary part of
         * one, as flags over unchanged memory, and its DLPack export hands out that memory as
         * it is: resolve them first (each returns the tensor itself unless its flag is set, and
         * makes one copy when it is), or the values sent would not be the tensor's.
         */
        PyObject *r = PyObject_CallMethodNoArgs(obj, cv.s_resolve_conj);
        if (r == NULL)
            goto fail;
        Py_SETREF(obj, r);
        r = PyObject_CallMethodNoArgs(obj, cv.s_resolve_neg);
        if (r == NULL)
            goto fail;
        Py_SETREF(obj, r);
    }
    for (int attempt = 0; attempt < 2; attempt++) {
        PyObject *dtype = PyObject_GetAttr(obj, cv.s_dtype);
        if (dtype == NULL)
            goto fail;
        int is_bool = dtype == cv.torch_bool;
        Py_DECREF(dtype);
        PyObject *src = obj;
        if (is_bool) {
            /* torch 1.13 exports no bool through DLPack: send the same bytes as uint8. */
            src = PyObject_CallMethodOneArg(obj, cv.s_view, cv.torch_uint8);
            if (src == NULL)
                goto fail;
        }
        PyObject *capsule = PyObject_CallOneArg(cv.torch_to_dlpack, src);
        if (src != obj)
            Py_DECREF(src);
        if (capsule == NULL)
            goto fail;
        int retry = 0;
        ts_value_t *v = tensor_from_capsule(capsule, is_bool, pins, &retry);
        Py_DECREF(capsule);
        if (v != NULL || !retry) {
            Py_DECREF(obj);
            return v != NULL ? v : export_error(orig);
        }
        if (attempt == 1) {
            record_error("%s.contiguous() returned a tensor that is not contiguous",
                         Py_TYPE(obj)->tp_name);
            goto fail;
        }
        /* Not contiguous: one copy, pinned like the original would have been. */
        PyObject *c = PyObject_CallMethodNoArgs(obj, cv.s_contiguous);
        if (c == NULL)
            goto fail;
        Py_SETREF(obj, c);
    }
fail:
    Py_DECREF(obj);
    return export_error(orig);
}

/* An object with __dlpack__ (not torch): its CPU tensor over its memory. */
static ts_value_t *tensor_from_dlpack_obj(PyObject *obj, PyObject *pins)
{
    PyObject *dev = PyObject_CallMethodNoArgs(obj, cv.s_dlpack_device);
    if (dev == NULL)
        return export_error(obj);
    int type = 0, id = 0;
    int ok = PyArg_ParseTuple(dev, "ii", &type, &id);
    Py_DECREF(dev);
    if (!ok)
        return export_error(obj);
    if (type != kDLCPU && type != kDLCUDAHost)
        return record_error("tensors on a device (DLPack device type %d) are not copied to "
                            "the host implicitly: copy it to the CPU first",
                            type);
    PyObject *capsule = PyObject_CallMethodNoArgs(obj, cv.s_dlpack);
    if (capsule == NULL)
        return export_error(obj);
    int retry = 0;
    ts_value_t *v = tensor_from_capsule(capsule, 0, pins, &retry);
    Py_DECREF(capsule);
    if (v == NULL && retry)
        return record_error("a non-contiguous DLPack tensor of type %s: make it contiguous "
                            "first",
                            Py_TYPE(obj)->tp_name);
    return v != NULL ? v : export_error(obj); /* not a DLPack capsule, or one used already */
}

/* ---------------------------------------------------------------------------------------------
 * Tensors from the buffer protocol (numpy arrays and scalars, memoryviews, array.array)
 */

/*
 * The dtype of a PEP 3118 format with the given item size, or TS_DTYPE_INVALID. Native or
 * little-endian byte order only (the wire is little-endian; this runs on little-endian hosts).
 */
static ts_dtype_t dtype_from_format(const char *f, Py_ssize_t itemsize)
{
    if (f == NULL)
        return itemsize == 1 ? TS_UINT8 : TS_DTYPE_INVALID;
    if (*f == '<' || *f == '@' || *f == '=')
        f++;
    /*
     * tensorshare.numpy_bfloat16 exactly (one little-endian u2 field named bfloat16); any other
     * structured dtype, one with such a field among others or of another type included, is
     * refused.
     */
    if (f[0] == 'T')
        return itemsize == 2 &&
                       (strcmp(f, "T{H:bfloat16:}") == 0 || strcmp(f, "T{<H:bfloat16:}") == 0 ||
                        strcmp(f, "T{=H:bfloat16:}") == 0)
                   ? TS_BFLOAT16
                   : TS_DTYPE_INVALID;
    if (f[0] == 'Z') {
        if ((f[1] == 'f' && f[2] == '\0' && itemsize == 8) ||
            (f[1] == 'd' && f[2] == '\0' && itemsize == 16))
            return itemsize == 8 ? TS_COMPLEX64 : TS_COMPLEX128;
        return TS_DTYPE_INVALID;
    }
    if (f[0] == '\0' || f[1] != '\0')
        return TS_DTYPE_INVALID;
    switch (f[0]) {
    case '?':
        return itemsize == 1 ? TS_BOOL : TS_DTYPE_INVALID;
    case 'B':
        return itemsize == 1 ? TS_UINT8 : TS_DTYPE_INVALID;
    case 'b':
    case 'h':
    case 'i':
    case 'l':
    case 'q':
    case 'n':
        return itemsize == 1   ? TS_INT8
               : itemsize == 2 ? TS_INT16
               : itemsize == 4 ? TS_INT32
               : itemsize == 8 ? TS_INT64
                               : TS_DTYPE_INVALID;
    case 'e':
        return itemsize == 2 ? TS_FLOAT16 : TS_DTYPE_INVALID;
    case 'f':
        return itemsize == 4 ? TS_FLOAT32 : TS_DTYPE_INVALID;
    case 'd':
        return itemsize == 8 ? TS_FLOAT64 : TS_DTYPE_INVALID;
    default:
        return TS_DTYPE_INVALID;
    }
}

static ts_value_t *tensor_from_buffer(PyObject *obj, PyObject *pins)
{
    PyObject *mv = PyMemoryView_FromObject(obj);
    if (mv == NULL)
        return export_error(obj); /* numpy exports no datetime64 or timedelta64 */
    const Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
    if (!PyBuffer_IsContiguous(b, 'C') || b->suboffsets != NULL) {
        /* Not contiguous: numpy makes the one copy; other exporters must do it themselves. */
        PyObject *contiguous = numpy_contiguous();
        if (contiguous == NULL || b->suboffsets != NULL) {
            Py_DECREF(mv);
            return record_error("a non-contiguous %s: make it contiguous first",
                                Py_TYPE(obj)->tp_name);
        }
        PyObject *c = PyObject_CallOneArg(contiguous, obj);
        Py_DECREF(mv);
        if (c == NULL)
            return export_error(obj);
        mv = PyMemoryView_FromObject(c);
        Py_DECREF(c);
        if (mv == NULL)
            return export_error(obj);
        b = PyMemoryView_GET_BUFFER(mv);
    }
    ts_value_t *v = NULL;
    ts_dtype_t dtype = dtype_from_format(b->format, b->itemsize);
    if (dtype == TS_DTYPE_INVALID) {
        const char *f = b->format != NULL ? b->format : "B";
        record_error("unsupported dtype (buffer format '%s', %zd bytes per item)%s: "
                     "tensorshare has bool, uint8, int8-64, float16, bfloat16, float32/64, "
                     "complex64/128",
                     f, b->itemsize,
                     strchr(f, 'O') != NULL ? ", object arrays hold references" : "");
        goto done;
    }
    if (b->ndim > TS_MAX_NDIM) {
        record_error("a tensor of %d dimensions: at most %d", b->ndim, TS_MAX_NDIM);
        goto done;
    }
    int64_t shape[TS_MAX_NDIM];
    for (int i = 0; i < b->ndim; i++)
        shape[i] = b->shape != NULL ? (int64_t)b->shape[i] : (int64_t)(b->len / b->itemsize);
    v = ts_tensor_new(dtype, b->ndim, shape, b->len == 0 ? NULL : b->buf, TS_BORROW);
    if (v == NULL) {
        record_error("the tensor was refused (shape too large?)");
        goto done;
    }
    if (PyList_Append(pins, mv) < 0) {
        ts_value_free(v);
        v = NULL;
    }
done:
    Py_DECREF(mv);
    return v;
}

/* ---------------------------------------------------------------------------------------------
 * Python -> record
 */

/* UTF-8 of a str (lone surrogates as surrogateescape bytes); *tmp holds a bytes object or NULL. */
static const char *utf8_of(PyObject *s, Py_ssize_t *len, PyObject **tmp)
{
    *tmp = NULL;
    const char *u = PyUnicode_AsUTF8AndSize(s, len);
    if (u != NULL)
        return u;
    PyErr_Clear();
    *tmp = PyUnicode_AsEncodedString(s, "utf-8", "surrogateescape");
    if (*tmp == NULL)
        return record_error("a string that is not valid Unicode");
    *len = PyBytes_GET_SIZE(*tmp);
    return PyBytes_AS_STRING(*tmp);
}

ts_value_t *tsp_value_from_py(PyObject *obj, PyObject *pins, int depth)
{
    if (depth > TS_MAX_DEPTH)
        return record_error("a record nested deeper than %d levels (or a container that holds "
                            "itself)",
                            TS_MAX_DEPTH);
    if (PyDict_Check(obj)) {
        ts_value_t *m = ts_map_new();
        if (m == NULL)
            return PyErr_NoMemory(), NULL;
        Py_ssize_t pos = 0;
        PyObject *k, *val;
        while (PyDict_Next(obj, &pos, &k, &val)) {
            if (!PyUnicode_Check(k)) {
                ts_value_free(m);
                return record_error("dict keys must be str, not %s", Py_TYPE(k)->tp_name);
            }
            Py_ssize_t klen;
            PyObject *tmp;
            const char *key = utf8_of(k, &klen, &tmp);
            if (key == NULL) {
                ts_value_free(m);
                return NULL;
            }
            if ((size_t)klen != strlen(key)) {
                Py_XDECREF(tmp);
                ts_value_free(m);
                return record_error("a dict key with a NUL character");
            }
            /*
             * The child may run Python code (torch, a __dlpack__ method) that changes the dict
             * and drops its references to k and val: hold both until the entry is added (key
             * points into k, or into tmp).
             */
            Py_INCREF(k);
            Py_INCREF(val);
            ts_value_t *child = tsp_value_from_py(val, pins, depth + 1);
            Py_DECREF(val);
            if (child == NULL) {
                Py_XDECREF(tmp);
                Py_DECREF(k);
                ts_value_free(m);
                return NULL;
            }
            int rc = ts_map_set(m, key, child);
            Py_XDECREF(tmp);
            Py_DECREF(k);
            if (rc != 0) {
                ts_value_free(m);
                return tsp_raise_msg(rc, "cannot add a map entry"), NULL;
            }
        }
        return m;
    }
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        ts_value_t *l = ts_list_new();
        if (l == NULL)
            return PyErr_NoMemory(), NULL;
        PyObject *seq = PySequence_Fast(obj, "a sequence");
        if (seq == NULL) {
            ts_value_free(l);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
            PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
            Py_INCREF(item);
            ts_value_t *child = tsp_value_from_py(item, pins, depth + 1);
            Py_DECREF(item);
            if (child == NULL) {
                Py_DECREF(seq);
                ts_value_free(l);
                return NULL;
            }
            int rc = ts_list_push(l, child);
            if (rc != 0) {
                Py_DECREF(seq);
                ts_value_free(l);
                return tsp_raise_msg(rc, "cannot add a list element"), NULL;
            }
        }
        Py_DECREF(seq);
        return l;
    }
    /*
     * A numpy scalar is a 0-d tensor with its dtype, even where its class also derives from
     * float or int (numpy.float64 is a float); only subclasses need the look.
     */
    if (((PyFloat_Check(obj) && !PyFloat_CheckExact(obj)) ||
         (PyLong_Check(obj) && !PyLong_CheckExact(obj) && !PyBool_Check(obj))) &&
        is_numpy_scalar(obj))
        return tensor_from_buffer(obj, pins);
    if (PyLong_Check(obj)) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (x == -1 && PyErr_Occurred())
            return NULL;
        if (overflow != 0)
            return record_error("an int outside the 64-bit signed range");
        ts_value_t *v = ts_int_new((int64_t)x);
        return v != NULL ? v : (PyErr_NoMemory(), NULL);
    }
    if (PyFloat_Check(obj)) {
        ts_value_t *v = ts_float_new(PyFloat_AS_DOUBLE(obj));
        return v != NULL ? v : (PyErr_NoMemory(), NULL);
    }
    if (PyUnicode_Check(obj)) {
        Py_ssize_t len;
        PyObject *tmp;
        const char *s = utf8_of(obj, &len, &tmp);
        if (s == NULL)
            return NULL;
        ts_value_t *v = ts_string_new(s, (size_t)len);
        Py_XDECREF(tmp);
        return v != NULL ? v : (PyErr_NoMemory(), NULL);
    }
    if (PyBytes_Check(obj)) {
        ts_value_t *v =
            ts_bytes_new(PyBytes_AS_STRING(obj), (size_t)PyBytes_GET_SIZE(obj), TS_COPY);
        return v != NULL ? v : (PyErr_NoMemory(), NULL);
    }
    if (PyByteArray_Check(obj)) {
        ts_value_t *v =
            ts_bytes_new(PyByteArray_AS_STRING(obj), (size_t)PyByteArray_GET_SIZE(obj), TS_COPY);
        return v != NULL ? v : (PyErr_NoMemory(), NULL);
    }
    torch_lookup();
    if (cv.torch_tensor != NULL && PyObject_TypeCheck(obj, cv.torch_tensor))
        return tensor_from_torch(obj, pins);
    if (PyObject_CheckBuffer(obj))
        return tensor_from_buffer(obj, pins);
    if (PyObject_HasAttr(obj, cv.s_dlpack) && PyObject_HasAttr(obj, cv.s_dlpack_device))
        return tensor_from_dlpack_obj(obj, pins);
    return record_error("a value of type %s cannot be sent: records hold dict (str keys), list, "
                        "tuple, int, float, str, bytes and tensors (torch, numpy, DLPack)",
                        Py_TYPE(obj)->tp_name);
}

int tsp_send_init(tsp_send_t *s, PyObject *obj)
{
    s->value = NULL;
    s->pins = PyList_New(0);
    if (s->pins == NULL)
        return -1;
    s->value = tsp_value_from_py(obj, s->pins, 1);
    if (s->value == NULL) {
        Py_CLEAR(s->pins);
        return -1;
    }
    return 0;
}

void tsp_send_clear(tsp_send_t *s)
{
    if (s->value != NULL) {
        ts_value_free(s->value);
        s->value = NULL;
    }
    Py_CLEAR(s->pins);
}

/* ---------------------------------------------------------------------------------------------
 * Record -> Python
 */

static PyObject *to_py(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner)
{
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP: {
        size_t n = ts_value_len(v);
        PyObject *d = PyDict_New();
        if (d == NULL)
            return NULL;
        for (size_t i = 0; i < n; i++) {
            const char *k = ts_map_key_at(v, i);
            PyObject *key = PyUnicode_DecodeUTF8(k, (Py_ssize_t)strlen(k), "surrogateescape");
            PyObject *val = key != NULL ? to_py(ts_map_value_at(v, i), tt, owner) : NULL;
            int rc = val != NULL ? PyDict_SetItem(d, key, val) : -1;
            Py_XDECREF(key);
            Py_XDECREF(val);
            if (rc < 0) {
                Py_DECREF(d);
                return NULL;
            }
        }
        return d;
    }
    case TS_TYPE_LIST: {
        size_t n = ts_value_len(v);
        PyObject *l = PyList_New((Py_ssize_t)n);
        if (l == NULL)
            return NULL;
        for (size_t i = 0; i < n; i++) {
            PyObject *x = to_py(ts_list_at(v, i), tt, owner);
            if (x == NULL) {
                Py_DECREF(l);
                return NULL;
            }
            PyList_SET_ITEM(l, (Py_ssize_t)i, x);
        }
        return l;
    }
    case TS_TYPE_TENSOR:
        return tsp_tensor_to_py(v, tt, owner);
    case TS_TYPE_INT: {
        int64_t x = 0;
        ts_value_int(v, &x);
        return PyLong_FromLongLong((long long)x);
    }
    case TS_TYPE_FLOAT: {
        double x = 0;
        ts_value_float(v, &x);
        return PyFloat_FromDouble(x);
    }
    case TS_TYPE_STRING: {
        const char *s = "";
        size_t len = 0;
        ts_value_string(v, &s, &len);
        return PyUnicode_DecodeUTF8(s, (Py_ssize_t)len, "surrogateescape");
    }
    case TS_TYPE_BYTES: {
        const void *p = NULL;
        size_t len = 0;
        ts_value_bytes(v, &p, &len);
        return PyBytes_FromStringAndSize(p, (Py_ssize_t)len);
    }
    default:
        return tsp_raise_msg(TS_EBADRECORD, "a value of an unknown type was received");
    }
}

PyObject *tsp_value_to_py_ex(const ts_value_t *v, tsp_tensor_type_t tt, tsp_owner_t *owner)
{
    if (tt == TSP_TENSOR_DEFAULT && (tt = tsp_tensor_type_default()) == TSP_TENSOR_DEFAULT)
        return NULL;
    return to_py(v, tt, owner);
}

PyObject *tsp_value_to_py(const ts_value_t *v, tsp_tensor_type_t tt)
{
    return tsp_value_to_py_ex(v, tt, NULL);
}

static void free_value(void *arg)
{
    ts_value_free(arg);
}

PyObject *tsp_value_to_py_owned(ts_value_t *v, tsp_tensor_type_t tt)
{
    tsp_owner_t *o = tsp_owner_new(free_value, v);
    if (o == NULL) {
        ts_value_free(v);
        return PyErr_NoMemory();
    }
    PyObject *r = tsp_value_to_py_ex(v, tt, o);
    tsp_owner_unref(o);
    return r;
}

PyObject *tsp_items_to_py(const ts_items_t *items, tsp_tensor_type_t tt)
{
    if (tt == TSP_TENSOR_DEFAULT && (tt = tsp_tensor_type_default()) == TSP_TENSOR_DEFAULT)
        return NULL;
    size_t n = ts_items_count(items);
    PyObject *l = PyList_New((Py_ssize_t)n);
    if (l == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++) {
        PyObject *x = to_py(ts_items_at(items, i), tt, NULL);
        if (x == NULL) {
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, (Py_ssize_t)i, x);
    }
    return l;
}

void tsp_hand_over_items(size_t n, tsp_item_fn item, void *arg, const char *note_fmt)
{
    PyObject *type, *val, *tb;
    PyErr_Fetch(&type, &val, &tb);
    PyErr_NormalizeException(&type, &val, &tb);
    if (val == NULL) {
        PyErr_Restore(type, val, tb);
        return;
    }
    size_t lost = 0;
    PyObject *all = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; all != NULL && i < n; i++) {
        PyObject *x = item(arg, i);
        if (x == NULL) {
            PyErr_Clear();
            x = Py_None;
            Py_INCREF(x);
            lost++;
        }
        PyList_SET_ITEM(all, (Py_ssize_t)i, x);
    }
    if (all == NULL || PyObject_SetAttrString(val, "items", all) < 0) {
        PyErr_Clear(); /* no memory even for that: the original exception goes on alone */
    } else {
        PyObject *note = PyUnicode_FromFormat(note_fmt, n, lost);
        PyObject *added = note != NULL ? PyObject_CallMethod(val, "add_note", "O", note) : NULL;
        Py_XDECREF(added);
        Py_XDECREF(note);
        if (added == NULL)
            PyErr_Clear(); /* add_note is new in Python 3.11: .items is the promise */
    }
    Py_XDECREF(all);
    PyErr_Restore(type, val, tb);
}

/* What taken_item converts: the items of a get, to tensors of type tt. */
typedef struct taken_items {
    const ts_items_t *items;
    tsp_tensor_type_t tt;
} taken_items;

/* The i-th item of a get on its own (tsp_item_fn). */
static PyObject *taken_item(void *arg, size_t i)
{
    const taken_items *t = arg;
    return tsp_value_to_py(ts_items_at(t->items, i), t->tt);
}

PyObject *tsp_taken_items_to_py(const ts_items_t *items, tsp_tensor_type_t tt)
{
    /* The callers ready tt before taking (tsp_tensor_type_ready), so this cannot fail then. */
    if (tt == TSP_TENSOR_DEFAULT && (tt = tsp_tensor_type_default()) == TSP_TENSOR_DEFAULT)
        return NULL;
    PyObject *r = tsp_items_to_py(items, tt);
    if (r != NULL)
        return r;
    /*
     * The items are out of the bin already: convert each one on its own, so that one that
     * cannot be made loses only itself, and hand them over on the exception.
     */
    taken_items t = {items, tt};
    tsp_hand_over_items(ts_items_count(items), taken_item, &t,
                        "tensorshare: the get took %zu items out of the bin; they are in this "
                        "exception's .items, oldest first (None for the %zu that could not be "
                        "converted)");
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Tensor types
 */

static tsp_tensor_type_t default_tt;

tsp_tensor_type_t tsp_tensor_type_default(void)
{
    if (default_tt != TSP_TENSOR_DEFAULT)
        return default_tt;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch != NULL) {
        Py_DECREF(torch);
        default_tt = TSP_TENSOR_TORCH;
    } else if (PyErr_ExceptionMatches(PyExc_ImportError)) {
        PyErr_Clear(); /* no torch here (ModuleNotFoundError, or one that cannot load) */
        default_tt = TSP_TENSOR_NUMPY;
    }
    /*
     * Anything else (KeyboardInterrupt from a Ctrl-C during the import, MemoryError) says
     * nothing about torch: it propagates, and the next conversion tries again.
     */
    return default_tt;
}

int tsp_tensor_type_from_py(PyObject *obj, tsp_tensor_type_t dflt, tsp_tensor_type_t *out)
{
    if (obj == NULL || obj == Py_None) {
        *out = dflt;
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        if (PyUnicode_CompareWithASCIIString(obj, "torch") == 0) {
            *out = TSP_TENSOR_TORCH;
            return 0;
        }
        if (PyUnicode_CompareWithASCIIString(obj, "numpy") == 0) {
            *out = TSP_TENSOR_NUMPY;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "tensor_type must be 'torch', 'numpy' or None, not %R", obj);
    return -1;
}

int tsp_convert_init(PyObject *module);
int tsp_convert_init(PyObject *module)
{
    (void)module;
    cv.s_dtype = PyUnicode_InternFromString("dtype");
    cv.s_view = PyUnicode_InternFromString("view");
    cv.s_contiguous = PyUnicode_InternFromString("contiguous");
    cv.s_dlpack = PyUnicode_InternFromString("__dlpack__");
    cv.s_dlpack_device = PyUnicode_InternFromString("__dlpack_device__");
    cv.s_resolve_conj = PyUnicode_InternFromString("resolve_conj");
    cv.s_resolve_neg = PyUnicode_InternFromString("resolve_neg");
    cv.s_layout = PyUnicode_InternFromString("layout");
    cv.s_device = PyUnicode_InternFromString("device");
    if (cv.s_dtype == NULL || cv.s_view == NULL || cv.s_contiguous == NULL || cv.s_dlpack == NULL ||
        cv.s_dlpack_device == NULL || cv.s_resolve_conj == NULL || cv.s_resolve_neg == NULL ||
        cv.s_layout == NULL || cv.s_device == NULL)
        return -1;
    return 0;
}
