/* .npy files and number literals for tsctl. */
#include "npy.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NPY_MAX_HEADER     65536 /* bytes; a .npy header is a short dict, this is generous */
#define LITERAL_MAX_VALUES 65536 /* numbers in a command-line literal */

static const struct {
    ts_dtype_t dtype;
    const char *descr;
} descrs[] = {
    {TS_BOOL, "|b1"},    {TS_UINT8, "|u1"},     {TS_INT8, "|i1"},        {TS_INT16, "<i2"},
    {TS_INT32, "<i4"},   {TS_INT64, "<i8"},     {TS_FLOAT16, "<f2"},     {TS_FLOAT32, "<f4"},
    {TS_FLOAT64, "<f8"}, {TS_COMPLEX64, "<c8"}, {TS_COMPLEX128, "<c16"},
};

/* Format a reason into err; returns code. */
static int fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return code;
}

const char *ts__npy_descr(ts_dtype_t dtype)
{
    for (size_t i = 0; i < sizeof(descrs) / sizeof(descrs[0]); i++)
        if (descrs[i].dtype == dtype)
            return descrs[i].descr;
    return NULL;
}

/* The dtype for a descr; '<' and '|' (and '=' on this little-endian format) are accepted. */
static ts_dtype_t dtype_of_descr(const char *d, size_t len)
{
    if (len < 2)
        return TS_DTYPE_INVALID;
    char order = d[0];
    if (order != '<' && order != '|' && order != '=')
        return TS_DTYPE_INVALID;
    for (size_t i = 0; i < sizeof(descrs) / sizeof(descrs[0]); i++) {
        const char *want = descrs[i].descr + 1;
        if (strlen(want) == len - 1 && memcmp(want, d + 1, len - 1) == 0)
            return descrs[i].dtype;
    }
    return TS_DTYPE_INVALID;
}

/* Find key ('name':) in a header dict and return the text after the colon, or NULL. */
static const char *dict_value(const char *hdr, const char *key)
{
    char pat[32];
    snprintf(pat, sizeof(pat), "'%s'", key);
    const char *p = strstr(hdr, pat);
    if (p == NULL)
        return NULL;
    p += strlen(pat);
    while (*p == ' ')
        p++;
    if (*p != ':')
        return NULL;
    p++;
    while (*p == ' ')
        p++;
    return p;
}

/* Parse the header dict: dtype, C order, shape. 0 or TS_EINVAL. */
static int parse_header(const char *hdr, ts_dtype_t *dtype, int *ndim, int64_t *shape, char *err,
                        size_t errlen)
{
    const char *d = dict_value(hdr, "descr");
    if (d == NULL || (*d != '\'' && *d != '"'))
        return fail(err, errlen, TS_EINVAL, "no 'descr' in the header");
    const char *end = strchr(d + 1, *d);
    if (end == NULL)
        return fail(err, errlen, TS_EINVAL, "bad 'descr' in the header");
    *dtype = dtype_of_descr(d + 1, (size_t)(end - d - 1));
    if (*dtype == TS_DTYPE_INVALID)
        return fail(err, errlen, TS_EINVAL, "unsupported dtype %.*s (little-endian numbers only)",
                    (int)(end - d - 1), d + 1);
    const char *f = dict_value(hdr, "fortran_order");
    if (f == NULL || strncmp(f, "False", 5) != 0)
        return fail(err, errlen, TS_EINVAL, "only C-order arrays are supported");
    const char *s = dict_value(hdr, "shape");
    if (s == NULL || *s != '(')
        return fail(err, errlen, TS_EINVAL, "no 'shape' in the header");
    s++;
    *ndim = 0;
    for (;;) {
        while (*s == ' ' || *s == ',')
            s++;
        if (*s == ')')
            break;
        if (!isdigit((unsigned char)*s))
            return fail(err, errlen, TS_EINVAL, "bad 'shape' in the header");
        if (*ndim == TS_MAX_NDIM)
            return fail(err, errlen, TS_EINVAL, "more than %d dimensions", TS_MAX_NDIM);
        char *next;
        errno = 0;
        long long v = strtoll(s, &next, 10);
        if (errno != 0 || v < 0)
            return fail(err, errlen, TS_EINVAL, "bad dimension in the header");
        shape[(*ndim)++] = v;
        s = next;
        if (*s == 'L') /* written by Python 2 */
            s++;
    }
    return 0;
}

int ts__npy_read(const char *path, ts_value_t **out, char *err, size_t errlen)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        return fail(err, errlen, TS_ENOENT, "%s: %s", path, strerror(errno));
    /* tsctl reads one file at a time: a static buffer keeps the header off the stack. */
    static char hdr[NPY_MAX_HEADER + 1];
    int rc = TS_EINVAL;
    ts_value_t *v = NULL;
    uint8_t pre[12];
    if (fread(pre, 1, 10, f) != 10 || memcmp(pre, "\x93NUMPY", 6) != 0) {
        fail(err, errlen, TS_EINVAL, "%s: not a .npy file", path);
        goto out;
    }
    size_t hlen;
    if (pre[6] == 1) {
        hlen = (size_t)pre[8] | ((size_t)pre[9] << 8);
    } else if (pre[6] == 2 || pre[6] == 3) {
        if (fread(pre + 10, 1, 2, f) != 2) {
            fail(err, errlen, TS_EINVAL, "%s: truncated header", path);
            goto out;
        }
        hlen = (size_t)pre[8] | ((size_t)pre[9] << 8) | ((size_t)pre[10] << 16) |
               ((size_t)pre[11] << 24);
    } else {
        fail(err, errlen, TS_EINVAL, "%s: unsupported .npy version %d", path, pre[6]);
        goto out;
    }
    if (hlen > NPY_MAX_HEADER) {
        fail(err, errlen, TS_EINVAL, "%s: header too large", path);
        goto out;
    }
    memset(hdr, 0, hlen + 1);
    if (fread(hdr, 1, hlen, f) != hlen) {
        fail(err, errlen, TS_EINVAL, "%s: truncated header", path);
        goto out;
    }
    ts_dtype_t dtype = TS_DTYPE_INVALID;
    int ndim = 0;
    int64_t shape[TS_MAX_NDIM];
    char why[200];
    if (parse_header(hdr, &dtype, &ndim, shape, why, sizeof(why)) != 0) {
        fail(err, errlen, TS_EINVAL, "%s: %s", path, why);
        goto out;
    }
    v = ts_tensor_alloc(dtype, ndim, shape);
    if (v == NULL) {
        rc = fail(err, errlen, TS_ENOMEM, "%s: cannot allocate the array", path);
        goto out;
    }
    const ts_tensor_t *t = ts_value_tensor(v);
    size_t n = ts_tensor_nbytes(t);
    if (n > 0 && fread(t->data, 1, n, f) != n) {
        fail(err, errlen, TS_EINVAL, "%s: truncated data (%zu bytes expected)", path, n);
        goto out;
    }
    *out = v;
    v = NULL;
    rc = 0;
out:
    ts_value_free(v);
    fclose(f);
    return rc;
}

int ts__npy_write_file(FILE *f, const char *name, const ts_tensor_t *t, char *err, size_t errlen)
{
    const char *descr = ts__npy_descr(t->dtype);
    if (descr == NULL)
        return fail(err, errlen, TS_ENOTSUP, "NumPy has no dtype for %s", ts_dtype_name(t->dtype));
    char dict[512];
    int n =
        snprintf(dict, sizeof(dict), "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
    for (int i = 0; i < t->ndim; i++)
        n += snprintf(dict + n, sizeof(dict) - (size_t)n, "%lld,%s", (long long)t->shape[i],
                      i + 1 < t->ndim ? " " : "");
    n += snprintf(dict + n, sizeof(dict) - (size_t)n, "), }");
    /* Pad with spaces so the data starts 64-byte aligned; the header ends with a newline. */
    size_t total = 10 + (size_t)n + 1;
    size_t padded = (total + 63) / 64 * 64;
    size_t hlen = padded - 10;
    uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, (uint8_t)hlen, (uint8_t)(hlen >> 8)};
    int ok = fwrite(pre, 1, 10, f) == 10 && fwrite(dict, 1, (size_t)n, f) == (size_t)n;
    for (size_t i = 10 + (size_t)n; ok && i < padded - 1; i++)
        ok = fputc(' ', f) != EOF;
    ok = ok && fputc('\n', f) != EOF;
    size_t bytes = ts_tensor_nbytes(t);
    ok = ok && (bytes == 0 || fwrite(t->data, 1, bytes, f) == bytes);
    ok = ok && fflush(f) == 0;
    if (!ok)
        return fail(err, errlen, TS_EACCES, "%s: write failed: %s", name, strerror(errno));
    return 0;
}

int ts__npy_write(const char *path, const ts_tensor_t *t, char *err, size_t errlen)
{
    if (ts__npy_descr(t->dtype) == NULL)
        return fail(err, errlen, TS_ENOTSUP, "NumPy has no dtype for %s", ts_dtype_name(t->dtype));
    FILE *f = fopen(path, "wb");
    if (f == NULL)
        return fail(err, errlen, TS_EACCES, "%s: %s", path, strerror(errno));
    int rc = ts__npy_write_file(f, path, t, err, errlen);
    if (fclose(f) != 0 && rc == 0)
        rc = fail(err, errlen, TS_EACCES, "%s: write failed: %s", path, strerror(errno));
    return rc;
}

/* Literal parser state. */
typedef struct lit {
    const char *p;
    float *vals;
    size_t n;
    int ndim;
    int64_t shape[TS_MAX_NDIM];
    int seen[TS_MAX_NDIM]; /* the length of each level is known */
    const char *why;
} lit;

static void skip_ws(lit *l)
{
    while (isspace((unsigned char)*l->p))
        l->p++;
}

/* A number: counted on the first pass, stored on the second (vals set). */
static int lit_number(lit *l)
{
    char *end;
    errno = 0;
    double d = strtod(l->p, &end);
    if (end == l->p || errno == ERANGE) {
        l->why = "expected a number";
        return -1;
    }
    l->p = end;
    if (l->n >= LITERAL_MAX_VALUES) {
        l->why = "too many numbers";
        return -1;
    }
    if (l->vals != NULL)
        l->vals[l->n] = (float)d;
    l->n++;
    return 0;
}

/* One element at nesting depth: a number at the innermost level, else a list. */
static int lit_value(lit *l, int depth)
{
    skip_ws(l);
    if (*l->p != '[') {
        if (depth != l->ndim) {
            l->why = "ragged nesting (the literal must be rectangular)";
            return -1;
        }
        return lit_number(l);
    }
    if (depth >= TS_MAX_NDIM) {
        l->why = "nested too deeply";
        return -1;
    }
    if (depth == l->ndim) {
        if (l->n > 0) {
            l->why = "ragged nesting (the literal must be rectangular)";
            return -1;
        }
        l->ndim++;
    }
    l->p++;
    int64_t count = 0;
    skip_ws(l);
    if (*l->p == ']') {
        l->p++;
    } else {
        for (;;) {
            if (lit_value(l, depth + 1) != 0)
                return -1;
            count++;
            skip_ws(l);
            if (*l->p == ',') {
                l->p++;
                continue;
            }
            if (*l->p == ']') {
                l->p++;
                break;
            }
            l->why = "expected ',' or ']'";
            return -1;
        }
    }
    if (!l->seen[depth]) {
        l->seen[depth] = 1;
        l->shape[depth] = count;
    } else if (l->shape[depth] != count) {
        l->why = "rows of different lengths";
        return -1;
    }
    return 0;
}

/* One pass over s. 0, or -1 with l->why. */
static int lit_pass(lit *l, const char *s)
{
    l->p = s;
    l->n = 0;
    l->ndim = 0;
    memset(l->seen, 0, sizeof(l->seen));
    if (lit_value(l, 0) != 0)
        return -1;
    skip_ws(l);
    if (*l->p != '\0') {
        l->why = "trailing characters";
        return -1;
    }
    return 0;
}

int ts__literal_parse(const char *s, ts_value_t **out, char *err, size_t errlen)
{
    /* First pass: the shape; then allocate the tensor and fill it on the second. */
    lit l;
    memset(&l, 0, sizeof(l));
    if (lit_pass(&l, s) != 0)
        return fail(err, errlen, TS_EINVAL, "cannot parse '%s': %s", s, l.why);
    for (int i = 0; i < l.ndim; i++)
        if (!l.seen[i]) /* below an empty list */
            l.shape[i] = 0;
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT32, l.ndim, l.shape);
    if (v == NULL)
        return fail(err, errlen, TS_ENOMEM, "out of memory");
    l.vals = ts_value_tensor(v)->data;
    if (l.n > 0)
        lit_pass(&l, s);
    *out = v;
    return 0;
}
