/* DLPack interop: zero-copy conversion between DLManagedTensor and tensorshare tensor values. */
#include "tensorshare/dlpack.h"

#include "record.h"

/* The tensorshare dtype for a DLPack dtype, or TS_DTYPE_INVALID. */
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
#if DLPACK_VERSION >= 80
    case kDLBool:
        return d.bits == 8 ? TS_BOOL : TS_DTYPE_INVALID;
#endif
    default:
        return TS_DTYPE_INVALID;
    }
}

/* The DLPack dtype for a tensorshare dtype (bool is uint8 where DLPack has no kDLBool). */
static DLDataType dtype_to_dl(ts_dtype_t t)
{
    DLDataType d = {.code = kDLUInt, .bits = 8, .lanes = 1};
    switch (t) {
    case TS_BOOL:
#if DLPACK_VERSION >= 80
        d.code = kDLBool;
#endif
        break;
    case TS_UINT8:
        break;
    case TS_INT8:
    case TS_INT16:
    case TS_INT32:
    case TS_INT64:
        d.code = kDLInt;
        break;
    case TS_FLOAT16:
    case TS_FLOAT32:
    case TS_FLOAT64:
        d.code = kDLFloat;
        break;
    case TS_BFLOAT16:
        d.code = kDLBfloat;
        break;
    case TS_COMPLEX64:
    case TS_COMPLEX128:
        d.code = kDLComplex;
        break;
    default:
        break;
    }
    d.bits = (uint8_t)(8 * ts_dtype_size(t));
    return d;
}

/* Calls the DLManagedTensor's deleter when the value that borrowed it is freed. */
static void release_dl(void *owner)
{
    DLManagedTensor *t = owner;
    if (t->deleter != NULL)
        t->deleter(t);
}

ts_value_t *ts_tensor_from_dlpack(DLManagedTensor *t)
{
    if (t == NULL)
        return NULL;
    const DLTensor *d = &t->dl_tensor;
    ts_dtype_t dtype = dtype_from_dl(d->dtype);
    if (dtype == TS_DTYPE_INVALID || d->ndim < 0 || d->ndim > TS_MAX_NDIM)
        return NULL;
    if (d->device.device_type != kDLCPU && d->device.device_type != kDLCUDAHost)
        return NULL;
    if (d->ndim > 0 && d->shape == NULL)
        return NULL;
    /* Compact row-major only: strides, when given, must be what C order implies. */
    if (d->strides != NULL) {
        int64_t expect = 1;
        for (int i = d->ndim - 1; i >= 0; i--) {
            if (d->shape[i] < 0)
                return NULL;
            if (d->shape[i] != 1 && d->strides[i] != expect)
                return NULL;
            /* An absurd shape must not overflow here; ts_tensor_new rejects it below. */
            if (__builtin_mul_overflow(expect, d->shape[i], &expect))
                return NULL;
        }
    }
    const void *data = d->data == NULL ? NULL : (const uint8_t *)d->data + d->byte_offset;
    ts_value_t *v = ts_tensor_new(dtype, d->ndim, d->shape, data, TS_BORROW);
    if (v == NULL)
        return NULL;
    v->release = release_dl;
    v->owner = t;
    return v;
}

/* What ts_value_to_dlpack hands out: the DLPack struct with room for the shape. */
typedef struct dl_export {
    DLManagedTensor mt;
    int64_t shape[TS_MAX_NDIM];
    ts__rbuf *rbuf; /* a reference on the receive buffer, or NULL for built values */
} dl_export;

static void dl_export_free(DLManagedTensor *self)
{
    dl_export *e = self->manager_ctx;
    ts__rbuf_unref(e->rbuf);
    ts__free(e);
}

int ts_value_to_dlpack(const ts_value_t *v, DLManagedTensor **out)
{
    if (v == NULL || out == NULL)
        return TS_EINVAL;
    const ts_tensor_t *t = ts_value_tensor(v);
    if (t == NULL)
        return TS_ETYPE;
    dl_export *e = ts__calloc(1, sizeof(*e));
    if (e == NULL)
        return TS_ENOMEM;
    for (int i = 0; i < t->ndim; i++)
        e->shape[i] = t->shape[i];
    e->rbuf = v->rbuf;
    if (e->rbuf != NULL)
        ts__rbuf_ref(e->rbuf);
    DLTensor *d = &e->mt.dl_tensor;
    d->data = t->data;
    d->device.device_type = kDLCPU;
    d->device.device_id = 0;
    d->ndim = t->ndim;
    d->dtype = dtype_to_dl(t->dtype);
    d->shape = e->shape;
    d->strides = NULL; /* compact, row-major */
    d->byte_offset = 0;
    e->mt.manager_ctx = e;
    e->mt.deleter = dl_export_free;
    *out = &e->mt;
    return 0;
}
