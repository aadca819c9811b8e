/* Value trees: building, reading, cloning and freeing. */
#include "record.h"

#include <stdint.h>

#define TS__MAX_KEY_LEN 65535 /* bytes; u16 length on the wire */

static ts_value_t *vnew(ts_type_t type)
{
    ts_value_t *v = ts__calloc(1, sizeof(*v));
    if (v != NULL)
        v->type = (uint8_t)type;
    return v;
}

ts_value_t *ts_map_new(void)
{
    return vnew(TS_TYPE_MAP);
}

ts_value_t *ts_list_new(void)
{
    return vnew(TS_TYPE_LIST);
}

ts_value_t *ts_int_new(int64_t x)
{
    ts_value_t *v = vnew(TS_TYPE_INT);
    if (v != NULL)
        v->u.i = x;
    return v;
}

ts_value_t *ts_float_new(double x)
{
    ts_value_t *v = vnew(TS_TYPE_FLOAT);
    if (v != NULL)
        v->u.f = x;
    return v;
}

ts_value_t *ts_string_new(const char *s, size_t len)
{
    if ((s == NULL && len > 0) || len > UINT32_MAX)
        return NULL;
    ts_value_t *v = vnew(TS_TYPE_STRING);
    if (v == NULL)
        return NULL;
    v->u.str = ts__strndup(s != NULL ? s : "", len);
    if (v->u.str == NULL) {
        ts__free(v);
        return NULL;
    }
    v->len = len;
    return v;
}

/* Point v at data, or at a private aligned copy with TS_COPY. 0 or TS_ENOMEM. */
static int vdata(ts_value_t *v, const void *data, size_t len, unsigned flags, const void **slot)
{
    if ((flags & TS_COPY) && len > 0) {
        void *copy = ts__malloc_aligned(len);
        if (copy == NULL)
            return TS_ENOMEM;
        memcpy(copy, data, len);
        *slot = copy;
        v->flags |= TS__VF_OWNS_DATA;
    } else {
        *slot = data;
    }
    return 0;
}

ts_value_t *ts_bytes_new(const void *data, size_t len, unsigned flags)
{
    if (data == NULL && len > 0)
        return NULL;
    ts_value_t *v = vnew(TS_TYPE_BYTES);
    if (v == NULL)
        return NULL;
    v->len = len;
    if (vdata(v, data, len, flags, &v->u.bytes) != 0) {
        ts__free(v);
        return NULL;
    }
    return v;
}

/* Check dtype/ndim/shape and compute the byte size. 0 or -1. */
static int tensor_size(ts_dtype_t dtype, int ndim, const int64_t *shape, size_t *bytes)
{
    size_t n = ts_dtype_size(dtype);
    if (n == 0 || ndim < 0 || ndim > TS_MAX_NDIM || (ndim > 0 && shape == NULL))
        return -1;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(n, (size_t)shape[i], &n))
            return -1;
    *bytes = n;
    return 0;
}

static ts_value_t *tensor_value(ts_dtype_t dtype, int ndim, const int64_t *shape)
{
    ts_value_t *v = vnew(TS_TYPE_TENSOR);
    if (v == NULL)
        return NULL;
    v->u.tensor.dtype = dtype;
    v->u.tensor.ndim = ndim;
    for (int i = 0; i < ndim; i++)
        v->u.tensor.shape[i] = shape[i];
    return v;
}

ts_value_t *ts_tensor_new(ts_dtype_t dtype, int ndim, const int64_t *shape, const void *data,
                          unsigned flags)
{
    size_t bytes;
    if (tensor_size(dtype, ndim, shape, &bytes) != 0 || (data == NULL && bytes > 0))
        return NULL;
    ts_value_t *v = tensor_value(dtype, ndim, shape);
    if (v == NULL)
        return NULL;
    const void *p;
    if (vdata(v, data, bytes, flags, &p) != 0) {
        ts__free(v);
        return NULL;
    }
    v->u.tensor.data = (void *)p;
    v->cap = bytes;
    return v;
}

ts_value_t *ts_tensor_new_external(ts_dtype_t dtype, int ndim, const int64_t *shape,
                                   const void *data, void (*release)(void *owner), void *owner)
{
    ts_value_t *v = ts_tensor_new(dtype, ndim, shape, data, TS_BORROW);
    if (v != NULL) {
        v->release = release;
        v->owner = owner;
    }
    return v;
}

int ts_value_tensor_set_rows(ts_value_t *v, int64_t rows)
{
    if (v == NULL || v->type != TS_TYPE_TENSOR || (v->flags & TS__VF_RECEIVED) ||
        v->u.tensor.ndim < 1 || rows < 0)
        return TS_EINVAL;
    /* The bytes of one row, then of rows rows: both overflow-checked against the memory. */
    size_t row_bytes = ts_dtype_size(v->u.tensor.dtype), bytes;
    for (int i = 1; i < v->u.tensor.ndim; i++)
        if (__builtin_mul_overflow(row_bytes, (size_t)v->u.tensor.shape[i], &row_bytes))
            return TS_EINVAL;
    if (__builtin_mul_overflow(row_bytes, (size_t)rows, &bytes) || bytes > v->cap)
        return TS_EINVAL;
    v->u.tensor.shape[0] = rows;
    return 0;
}

ts_value_t *ts_tensor_alloc(ts_dtype_t dtype, int ndim, const int64_t *shape)
{
    size_t bytes;
    if (tensor_size(dtype, ndim, shape, &bytes) != 0)
        return NULL;
    ts_value_t *v = tensor_value(dtype, ndim, shape);
    if (v == NULL)
        return NULL;
    if (bytes > 0) {
        v->u.tensor.data = ts__malloc_aligned(bytes);
        if (v->u.tensor.data == NULL) {
            ts__free(v);
            return NULL;
        }
        memset(v->u.tensor.data, 0, bytes);
        v->flags |= TS__VF_OWNS_DATA;
    }
    v->cap = bytes;
    return v;
}

/* Make room for one more entry in a built container. 0 or TS_ENOMEM. */
static int grow(ts_value_t *c)
{
    if (c->len < c->cap)
        return 0;
    size_t cap = c->cap ? c->cap * 2 : 4;
    ts_value_t **items = ts__realloc(c->u.c.items, cap * sizeof(*items));
    if (items == NULL)
        return TS_ENOMEM;
    c->u.c.items = items;
    if (c->type == TS_TYPE_MAP) {
        char **keys = ts__realloc(c->u.c.keys, cap * sizeof(*keys));
        if (keys == NULL)
            return TS_ENOMEM;
        c->u.c.keys = keys;
    }
    c->cap = cap;
    return 0;
}

int ts_map_set(ts_value_t *map, const char *key, ts_value_t *child)
{
    if (child == NULL)
        return TS_ENOMEM;
    if (map == NULL || map->type != TS_TYPE_MAP || (map->flags & TS__VF_RECEIVED) || key == NULL ||
        strlen(key) > TS__MAX_KEY_LEN || child == map) {
        ts_value_free(child);
        return TS_EINVAL;
    }
    for (size_t i = 0; i < map->len; i++) {
        if (strcmp(map->u.c.keys[i], key) == 0) {
            ts_value_free(map->u.c.items[i]);
            map->u.c.items[i] = child;
            return 0;
        }
    }
    char *k = ts__strndup(key, strlen(key));
    if (k == NULL || grow(map) != 0) {
        ts__free(k);
        ts_value_free(child);
        return TS_ENOMEM;
    }
    map->u.c.keys[map->len] = k;
    map->u.c.items[map->len] = child;
    map->len++;
    return 0;
}

int ts_list_push(ts_value_t *list, ts_value_t *child)
{
    if (child == NULL)
        return TS_ENOMEM;
    if (list == NULL || list->type != TS_TYPE_LIST || (list->flags & TS__VF_RECEIVED) ||
        child == list || list->len >= UINT32_MAX) {
        ts_value_free(child);
        return TS_EINVAL;
    }
    if (grow(list) != 0) {
        ts_value_free(child);
        return TS_ENOMEM;
    }
    list->u.c.items[list->len++] = child;
    return 0;
}

void ts_value_free(ts_value_t *v)
{
    if (v == NULL)
        return;
    if (v->flags & TS__VF_RECEIVED) {
        /* Received trees are freed by whoever returned them; only a root may be passed here. */
        if (v->flags & TS__VF_ROOT)
            ts__record_tree_free(v);
        return;
    }
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        for (size_t i = 0; i < v->len; i++) {
            ts_value_free(v->u.c.items[i]);
            if (v->type == TS_TYPE_MAP)
                ts__free(v->u.c.keys[i]);
        }
        ts__free(v->u.c.items);
        ts__free(v->u.c.keys);
        break;
    case TS_TYPE_STRING:
        ts__free(v->u.str);
        break;
    case TS_TYPE_TENSOR:
        if (v->flags & TS__VF_OWNS_DATA)
            ts__free_aligned(v->u.tensor.data, v->cap); /* as allocated, whatever the rows now */
        break;
    case TS_TYPE_BYTES:
        if (v->flags & TS__VF_OWNS_DATA)
            ts__free_aligned((void *)v->u.bytes, v->len);
        break;
    default:
        break;
    }
    if (v->release != NULL)
        v->release(v->owner);
    ts__free(v);
}

ts_type_t ts_value_type(const ts_value_t *v)
{
    return (ts_type_t)v->type;
}

size_t ts_value_len(const ts_value_t *v)
{
    if (v == NULL || (v->type != TS_TYPE_MAP && v->type != TS_TYPE_LIST))
        return 0;
    return v->len;
}

const ts_value_t *ts_map_get(const ts_value_t *map, const char *key)
{
    if (map == NULL || map->type != TS_TYPE_MAP || key == NULL)
        return NULL;
    for (size_t i = 0; i < map->len; i++)
        if (strcmp(map->u.c.keys[i], key) == 0)
            return map->u.c.items[i];
    return NULL;
}

const char *ts_map_key_at(const ts_value_t *map, size_t i)
{
    if (map == NULL || map->type != TS_TYPE_MAP || i >= map->len)
        return NULL;
    return map->u.c.keys[i];
}

const ts_value_t *ts_map_value_at(const ts_value_t *map, size_t i)
{
    if (map == NULL || map->type != TS_TYPE_MAP || i >= map->len)
        return NULL;
    return map->u.c.items[i];
}

const ts_value_t *ts_list_at(const ts_value_t *list, size_t i)
{
    if (list == NULL || list->type != TS_TYPE_LIST || i >= list->len)
        return NULL;
    return list->u.c.items[i];
}

const ts_tensor_t *ts_value_tensor(const ts_value_t *v)
{
    if (v == NULL || v->type != TS_TYPE_TENSOR)
        return NULL;
    return &v->u.tensor;
}

int ts_value_int(const ts_value_t *v, int64_t *out)
{
    if (v == NULL || v->type != TS_TYPE_INT)
        return TS_ETYPE;
    *out = v->u.i;
    return 0;
}

int ts_value_float(const ts_value_t *v, double *out)
{
    if (v != NULL && v->type == TS_TYPE_INT) {
        *out = (double)v->u.i;
        return 0;
    }
    if (v == NULL || v->type != TS_TYPE_FLOAT)
        return TS_ETYPE;
    *out = v->u.f;
    return 0;
}

int ts_value_string(const ts_value_t *v, const char **s, size_t *len)
{
    if (v == NULL || v->type != TS_TYPE_STRING)
        return TS_ETYPE;
    *s = v->u.str;
    if (len != NULL)
        *len = v->len;
    return 0;
}

int ts_value_bytes(const ts_value_t *v, const void **data, size_t *len)
{
    if (v == NULL || v->type != TS_TYPE_BYTES)
        return TS_ETYPE;
    *data = v->u.bytes;
    if (len != NULL)
        *len = v->len;
    return 0;
}

int ts_map_get_int(const ts_value_t *map, const char *key, int64_t *out)
{
    const ts_value_t *v = ts_map_get(map, key);
    if (v == NULL)
        return TS_ENOENT;
    return ts_value_int(v, out);
}

const ts_tensor_t *ts_map_get_tensor(const ts_value_t *map, const char *key)
{
    return ts_value_tensor(ts_map_get(map, key));
}

ts_value_t *ts_value_clone(const ts_value_t *v)
{
    if (v == NULL)
        return NULL;
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        ts_value_t *c = vnew((ts_type_t)v->type);
        if (c == NULL)
            return NULL;
        for (size_t i = 0; i < v->len; i++) {
            ts_value_t *child = ts_value_clone(v->u.c.items[i]);
            int rc = v->type == TS_TYPE_MAP ? ts_map_set(c, v->u.c.keys[i], child)
                                            : ts_list_push(c, child);
            if (rc != 0) {
                ts_value_free(c);
                return NULL;
            }
        }
        return c;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = &v->u.tensor;
        return ts_tensor_new(t->dtype, t->ndim, t->shape, t->data, TS_COPY);
    }
    case TS_TYPE_INT:
        return ts_int_new(v->u.i);
    case TS_TYPE_FLOAT:
        return ts_float_new(v->u.f);
    case TS_TYPE_STRING:
        return ts_string_new(v->u.str, v->len);
    case TS_TYPE_BYTES:
        return ts_bytes_new(v->u.bytes, v->len, TS_COPY);
    default:
        return NULL;
    }
}

static ts_value_t *borrow(const ts_value_t *v, int depth)
{
    if (v == NULL || depth > TS_MAX_DEPTH)
        return NULL;
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int map = v->type == TS_TYPE_MAP;
        ts_value_t *c = vnew((ts_type_t)v->type);
        for (size_t i = 0; c != NULL && i < ts_value_len(v); i++) {
            const ts_value_t *child = map ? ts_map_value_at(v, i) : ts_list_at(v, i);
            ts_value_t *mine = borrow(child, depth + 1);
            int rc = map ? ts_map_set(c, ts_map_key_at(v, i), mine) : ts_list_push(c, mine);
            if (rc != 0) {
                ts_value_free(c);
                c = NULL;
            }
        }
        return c;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        return ts_tensor_new(t->dtype, t->ndim, t->shape, t->data, TS_BORROW);
    }
    case TS_TYPE_BYTES: {
        const void *d;
        size_t n;
        return ts_value_bytes(v, &d, &n) == 0 ? ts_bytes_new(d, n, TS_BORROW) : NULL;
    }
    default:
        return ts_value_clone(v); /* scalars and strings: small, copied */
    }
}

ts_value_t *ts_value_borrow(const ts_value_t *v)
{
    return borrow(v, 1);
}

size_t ts_value_encoded_size(const ts_value_t *v)
{
    ts__enc e;
    if (ts__record_plan(v, &e) != 0)
        return 0;
    size_t n = e.total;
    ts__enc_free(&e);
    return n;
}
