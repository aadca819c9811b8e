/*
 * Schemas of the batcher: the dotted-path fields a request's value tree must have (each a tensor
 * with a batch dimension in front of its per-row shape), the check of a tree against them, the
 * allocation of a batch tree for them, and the check of a model's output.
 */
#include "batcher_internal.h"

#include <stdio.h>
#include <string.h>

void ts__schema_free(schema_field *f, int n)
{
    if (f == NULL)
        return;
    for (int i = 0; i < n; i++) {
        ts__free(f[i].name);
        ts__free(f[i].parts);
        ts__free(f[i].path_buf);
    }
    ts__free(f);
}

/* Split a dotted name into its components. 0, TS_EINVAL (empty component) or TS_ENOMEM. */
static int field_split(schema_field *f)
{
    size_t len = strlen(f->name);
    if (len == 0) {
        f->nparts = 0;
        return 0;
    }
    f->path_buf = ts__strndup(f->name, len);
    int n = 1;
    for (size_t i = 0; i < len; i++)
        n += f->name[i] == '.';
    f->parts = ts__calloc((size_t)n, sizeof(char *));
    if (f->path_buf == NULL || f->parts == NULL)
        return TS_ENOMEM;
    char *p = f->path_buf;
    for (int i = 0; i < n; i++) {
        char *dot = strchr(p, '.');
        if (dot != NULL)
            *dot = '\0';
        if (*p == '\0')
            return TS_EINVAL;
        f->parts[i] = p;
        p = dot != NULL ? dot + 1 : p + strlen(p);
    }
    f->nparts = n;
    return 0;
}

/* 1 when the path of a is a prefix of (or equal to) the path of b. */
static int path_prefix(const schema_field *a, const schema_field *b)
{
    if (a->nparts > b->nparts)
        return 0;
    for (int i = 0; i < a->nparts; i++)
        if (strcmp(a->parts[i], b->parts[i]) != 0)
            return 0;
    return 1;
}

int ts__schema_copy(const ts_field_t *in, int n, const char *what, schema_field **out)
{
    if (n < 0 || n > TS_BATCHER_MAX_FIELDS || (n > 0 && in == NULL)) {
        ts__batcher_set_err("%s schema: 0..%d fields expected", what, TS_BATCHER_MAX_FIELDS);
        return TS_EINVAL;
    }
    schema_field *f = ts__calloc((size_t)(n > 0 ? n : 1), sizeof(*f));
    if (f == NULL)
        return TS_ENOMEM;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const ts_field_t *s = &in[i];
        size_t esize = ts_dtype_size(s->dtype);
        if (s->name == NULL || esize == 0 || s->ndim < 0 || s->ndim >= TS_MAX_NDIM) {
            ts__batcher_set_err(
                "%s schema: field %d has no name, an unknown dtype or ndim outside 0..%d", what, i,
                TS_MAX_NDIM - 1);
            rc = TS_EINVAL;
            break;
        }
        f[i].name = ts__strndup(s->name, strlen(s->name));
        if (f[i].name == NULL) {
            rc = TS_ENOMEM;
            break;
        }
        f[i].dtype = s->dtype;
        f[i].ndim = s->ndim;
        size_t rb = esize;
        for (int d = 0; d < s->ndim && rc == 0; d++) {
            f[i].shape[d] = s->shape[d];
            if (s->shape[d] < 0) {
                ts__batcher_set_err("%s schema: field '%s' has a negative per-row dimension %d "
                                    "(%lld)",
                                    what, s->name, d, (long long)s->shape[d]);
                rc = TS_EINVAL;
            } else if (__builtin_mul_overflow(rb, (size_t)s->shape[d], &rb)) {
                ts__batcher_set_err("%s schema: field '%s' has a per-row shape whose size in "
                                    "bytes overflows (at per-row dimension %d)",
                                    what, s->name, d);
                rc = TS_EINVAL;
            }
        }
        if (rc != 0)
            break;
        f[i].row_bytes = rb;
        rc = field_split(&f[i]);
        if (rc == TS_EINVAL)
            ts__batcher_set_err("%s schema: bad field name '%s' (an empty component)", what,
                                s->name);
    }
    for (int i = 0; i < n && rc == 0; i++) {
        if (f[i].nparts == 0 && n > 1) {
            ts__batcher_set_err("%s schema: an unnamed field must be the only one", what);
            rc = TS_EINVAL;
        }
        for (int j = 0; j < n && rc == 0; j++) {
            if (i != j && path_prefix(&f[i], &f[j])) {
                ts__batcher_set_err("%s schema: fields '%s' and '%s' overlap", what, f[i].name,
                                    f[j].name);
                rc = TS_EINVAL;
            }
        }
    }
    if (rc != 0) {
        ts__schema_free(f, n);
        return rc;
    }
    *out = f;
    return 0;
}

/* The value at a field's path, or NULL. */
static const ts_value_t *field_find(const schema_field *f, const ts_value_t *root)
{
    const ts_value_t *v = root;
    for (int i = 0; i < f->nparts && v != NULL; i++)
        v = ts_value_type(v) == TS_TYPE_MAP ? ts_map_get(v, f->parts[i]) : NULL;
    return v;
}

/* bytes; "[d0, d1, ...]" of up to TS_MAX_NDIM int64 dimensions, cut (with "...") past this */
#define SHAPE_TEXT_LEN 96

/* Write "[d0, d1, ...]" (ndim values of shape) into buf; cut short when buf is too small. */
static void shape_text(char *buf, size_t len, const int64_t *shape, int ndim)
{
    size_t at = (size_t)snprintf(buf, len, "[");
    for (int d = 0; d < ndim && at < len; d++)
        at +=
            (size_t)snprintf(buf + at, len - at, "%s%lld", d > 0 ? ", " : "", (long long)shape[d]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
    else if (len >= 4)
        memcpy(buf + len - 4, "...", 4);
}

/* Leaves of a tree: every value that is not a map. */
static size_t count_leaves(const ts_value_t *v)
{
    if (ts_value_type(v) != TS_TYPE_MAP)
        return 1;
    size_t n = 0;
    for (size_t i = 0; i < ts_value_len(v); i++)
        n += count_leaves(ts_map_value_at(v, i));
    return n;
}

/*
 * Find the first entry of the map v that no field names, depth first. v is at depth d of the
 * tree, on the path of the first d parts of field f[on]. Writes the entry's dotted path into
 * path and returns 1, or returns 0 when every entry is a field or on the way to one. The
 * recursion goes no deeper than the fields' paths.
 */
static int find_extra(const schema_field *f, int n, int on, int d, const ts_value_t *v, char *path,
                      size_t len)
{
    for (size_t k = 0; k < ts_value_len(v); k++) {
        const char *key = ts_map_key_at(v, k);
        int named = -1, exact = 0;
        for (int j = 0; j < n && !exact; j++) {
            int same = f[j].nparts > d && strcmp(f[j].parts[d], key) == 0;
            for (int p = 0; same && p < d; p++)
                same = strcmp(f[j].parts[p], f[on].parts[p]) == 0;
            if (same) {
                named = j;
                exact = f[j].nparts == d + 1;
            }
        }
        if (named < 0) {
            size_t at = 0;
            for (int p = 0; p < d && at < len; p++)
                at += (size_t)snprintf(path + at, len - at, "%s.", f[on].parts[p]);
            if (at < len)
                snprintf(path + at, len - at, "%s", key);
            return 1;
        }
        const ts_value_t *c = ts_map_value_at(v, k);
        if (!exact && ts_value_type(c) == TS_TYPE_MAP &&
            find_extra(f, n, named, d + 1, c, path, len))
            return 1;
    }
    return 0;
}

int ts__schema_check(const schema_field *f, int n, const ts_value_t *root, int64_t max_rows,
                     int64_t *rows, const ts_tensor_t **leaves, char *msg, size_t msglen)
{
    if (root == NULL) {
        snprintf(msg, msglen, "no value");
        return TS_ESCHEMA;
    }
    int64_t r = *rows;
    for (int i = 0; i < n; i++) {
        const ts_value_t *v = field_find(&f[i], root);
        const ts_tensor_t *t = v != NULL ? ts_value_tensor(v) : NULL;
        if (t == NULL) {
            snprintf(msg, msglen, "field '%s' is missing or not a tensor", f[i].name);
            return TS_ESCHEMA;
        }
        if (t->dtype != f[i].dtype) {
            snprintf(msg, msglen, "field '%s' is %s, expected %s", f[i].name,
                     ts_dtype_name(t->dtype) ? ts_dtype_name(t->dtype) : "?",
                     ts_dtype_name(f[i].dtype));
            return TS_ESCHEMA;
        }
        if (t->ndim != f[i].ndim + 1) {
            char has[SHAPE_TEXT_LEN], want[SHAPE_TEXT_LEN];
            shape_text(has, sizeof(has), t->shape, t->ndim);
            shape_text(want, sizeof(want), f[i].shape, f[i].ndim);
            if (f[i].ndim == 0)
                snprintf(msg, msglen,
                         "field '%s' has shape %s, expected 1 dimension (the batch dimension: "
                         "one value per row)",
                         f[i].name, has);
            else
                snprintf(msg, msglen,
                         "field '%s' has shape %s, expected %d dimensions (the batch dimension, "
                         "then the per-row shape %s)",
                         f[i].name, has, f[i].ndim + 1, want);
            return TS_ESCHEMA;
        }
        for (int d = 0; d < f[i].ndim; d++) {
            if (t->shape[d + 1] == f[i].shape[d])
                continue;
            char has[SHAPE_TEXT_LEN], want[SHAPE_TEXT_LEN];
            shape_text(has, sizeof(has), t->shape + 1, f[i].ndim);
            shape_text(want, sizeof(want), f[i].shape, f[i].ndim);
            snprintf(msg, msglen,
                     "field '%s' has per-row shape %s, expected %s (per-row dimension %d is "
                     "%lld, expected %lld)",
                     f[i].name, has, want, d, (long long)t->shape[d + 1], (long long)f[i].shape[d]);
            return TS_ESCHEMA;
        }
        if (*rows > 0 && t->shape[0] != *rows) {
            snprintf(msg, msglen, "field '%s' has %lld rows, expected %lld", f[i].name,
                     (long long)t->shape[0], (long long)*rows);
            return TS_ESCHEMA;
        }
        if (r == 0)
            r = t->shape[0];
        if (t->shape[0] < 1 || t->shape[0] > max_rows) {
            snprintf(msg, msglen, "field '%s' has %lld rows, expected 1 to %lld", f[i].name,
                     (long long)t->shape[0], (long long)max_rows);
            return TS_ESCHEMA;
        }
        if (t->shape[0] != r) {
            snprintf(msg, msglen, "field '%s' has %lld rows, expected %lld as the fields before it",
                     f[i].name, (long long)t->shape[0], (long long)r);
            return TS_ESCHEMA;
        }
        if (leaves != NULL)
            leaves[i] = t;
    }
    if (count_leaves(root) != (size_t)n) {
        /* Every field was found, so root is a map (a bare tensor has one leaf, and n >= 1). */
        char path[TS__BERR_LEN] = "";
        if (find_extra(f, n, 0, 0, root, path, sizeof(path)))
            snprintf(msg, msglen, "the value has an entry the schema does not name: '%s'", path);
        else
            snprintf(msg, msglen, "the value has entries the schema does not name");
        return TS_ESCHEMA;
    }
    *rows = r;
    return 0;
}

ts_value_t *ts__schema_alloc(const schema_field *f, int n, int64_t rows, ts_value_t **leaves)
{
    ts_value_t *root = NULL;
    for (int i = 0; i < n; i++) {
        int64_t shape[TS_MAX_NDIM];
        shape[0] = rows;
        for (int d = 0; d < f[i].ndim; d++)
            shape[d + 1] = f[i].shape[d];
        ts_value_t *t = ts_tensor_alloc(f[i].dtype, f[i].ndim + 1, shape);
        if (t == NULL)
            goto fail;
        leaves[i] = t;
        if (f[i].nparts == 0) {
            root = t;
            break;
        }
        if (root == NULL && (root = ts_map_new()) == NULL) {
            ts_value_free(t);
            goto fail;
        }
        ts_value_t *m = root;
        for (int p = 0; p < f[i].nparts - 1; p++) {
            ts_value_t *next = (ts_value_t *)ts_map_get(m, f[i].parts[p]);
            if (next == NULL) {
                if (ts_map_set(m, f[i].parts[p], ts_map_new()) != 0) {
                    ts_value_free(t);
                    goto fail;
                }
                next = (ts_value_t *)ts_map_get(m, f[i].parts[p]);
            }
            m = next;
        }
        if (ts_map_set(m, f[i].parts[f[i].nparts - 1], t) != 0)
            goto fail;
    }
    return root;
fail:
    ts_value_free(root);
    return NULL;
}

int ts__output_check(const schema_field *f, int n, const ts_value_t *v, int64_t rows, char *msg,
                     size_t msglen)
{
    if (n > 0) {
        int64_t r = rows;
        return ts__schema_check(f, n, v, rows, &r, NULL, msg, msglen);
    }
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        for (size_t i = 0; i < ts_value_len(v); i++) {
            const ts_value_t *c =
                ts_value_type(v) == TS_TYPE_MAP ? ts_map_value_at(v, i) : ts_list_at(v, i);
            int rc = ts__output_check(f, n, c, rows, msg, msglen);
            if (rc != 0)
                return rc;
        }
        return 0;
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        if (t->ndim < 1 || t->shape[0] != rows) {
            snprintf(msg, msglen, "an output tensor lacks the batch dimension of %lld rows",
                     (long long)rows);
            return TS_ESCHEMA;
        }
        return 0;
    }
    default:
        return 0;
    }
}
