/* The dtype table: wire code, element size and name. */
#include "common.h"

static const struct {
    size_t size;
    const char *name;
} dtypes[] = {
    [TS_BOOL] = {1, "bool"},           [TS_UINT8] = {1, "uint8"},
    [TS_INT8] = {1, "int8"},           [TS_INT16] = {2, "int16"},
    [TS_INT32] = {4, "int32"},         [TS_INT64] = {8, "int64"},
    [TS_FLOAT16] = {2, "float16"},     [TS_BFLOAT16] = {2, "bfloat16"},
    [TS_FLOAT32] = {4, "float32"},     [TS_FLOAT64] = {8, "float64"},
    [TS_COMPLEX64] = {8, "complex64"}, [TS_COMPLEX128] = {16, "complex128"},
};

size_t ts_dtype_size(ts_dtype_t dtype)
{
    if ((int)dtype <= 0 || (size_t)dtype >= TS__ARRAY_SIZE(dtypes))
        return 0;
    return dtypes[dtype].size;
}

const char *ts_dtype_name(ts_dtype_t dtype)
{
    if ((int)dtype <= 0 || (size_t)dtype >= TS__ARRAY_SIZE(dtypes))
        return NULL;
    return dtypes[dtype].name;
}

ts_dtype_t ts_dtype_from_name(const char *name)
{
    if (name == NULL)
        return TS_DTYPE_INVALID;
    for (size_t i = 1; i < TS__ARRAY_SIZE(dtypes); i++)
        if (strcmp(dtypes[i].name, name) == 0)
            return (ts_dtype_t)i;
    return TS_DTYPE_INVALID;
}

int64_t ts_tensor_numel(const ts_tensor_t *t)
{
    /*
     * Unsigned arithmetic: a shape with a zero dimension is valid even when the product of the
     * dimensions before the zero exceeds INT64_MAX (the record validator and the builders bound
     * the running product in 64 unsigned bits), and signed overflow would be undefined.
     */
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (uint64_t)t->shape[i];
    return (int64_t)n;
}

size_t ts_tensor_nbytes(const ts_tensor_t *t)
{
    return (size_t)ts_tensor_numel(t) * ts_dtype_size(t->dtype);
}
