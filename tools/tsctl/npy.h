/*
 * Reading and writing NumPy .npy files (format versions 1-3, little-endian, C order) and parsing
 * number literals for tsctl. Not part of the library.
 */
#ifndef TS_NPY_H
#define TS_NPY_H

#include <stddef.h>
#include <stdio.h>

#include "tensorshare/tensorshare.h"

/*
 * Read path into a new tensor value that owns its data. Returns 0 and *out, or a TS_E* code with
 * a reason in err (errlen bytes).
 */
int ts__npy_read(const char *path, ts_value_t **out, char *err, size_t errlen);

/* Write t to path as a version 1.0 .npy file. 0 or a TS_E* code with a reason in err. */
int ts__npy_write(const char *path, const ts_tensor_t *t, char *err, size_t errlen);

/*
 * Write t as a .npy file to the open stream f (flushed, not closed; name only labels errors), so
 * that a caller can write to a temporary file and rename it. 0 or a TS_E* code with a reason.
 */
int ts__npy_write_file(FILE *f, const char *name, const ts_tensor_t *t, char *err, size_t errlen);

/*
 * Parse a literal: a number ("3.5") gives a 0-d float32 tensor, a bracketed list ("[1,2,3]",
 * "[[1,2],[3,4]]", rectangular) a float32 tensor of that shape. 0 or TS_EINVAL with a reason.
 */
int ts__literal_parse(const char *s, ts_value_t **out, char *err, size_t errlen);

/* The .npy descr ("<f4", "|u1", ...) for a dtype, or NULL when NumPy has none. */
const char *ts__npy_descr(ts_dtype_t dtype);

#endif /* TS_NPY_H */
