/*
 * Shared declarations of the fuzz targets. Each target defines LLVMFuzzerTestOneInput; with clang
 * libFuzzer drives it, with other compilers fuzz_driver.c replays a corpus and mutations of it.
 */
#ifndef TS_FUZZ_H
#define TS_FUZZ_H

#include <stddef.h>
#include <stdint.h>

#include "record.h"

/* The entry point libFuzzer calls; returns 0 (anything else is reserved by libFuzzer). */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/*
 * Abort with a message when cond is false: the fuzzer reports an abort as a crash and keeps the
 * input. Used for properties (not memory errors, which the sanitizers catch on their own).
 */
#define FZ_CHECK(cond)                                                                             \
    do {                                                                                           \
        if (!(cond))                                                                               \
            ts__fz_fail(__FILE__, __LINE__, #cond);                                                \
    } while (0)

_Noreturn void ts__fz_fail(const char *file, int line, const char *what);

/*
 * Check the record at rec[0..len) end to end: validation at the protocol's limits and at tighter
 * ones, decoding (it must succeed exactly when validation does), a walk over the decoded tree that
 * touches every pointer it holds, re-encoding and a structural comparison, and an allocation
 * failure during decoding. Returns 0 when the record is valid, TS_EBADRECORD otherwise.
 */
int ts__fz_check_record(const uint8_t *rec, size_t len);

/*
 * The same for a record at buf->data[off .. off+len), decoded in place (as the items of a GET
 * reply are): every tensor and byte string must point inside that range.
 */
int ts__fz_check_record_in(ts__rbuf *buf, size_t off, size_t len);

#endif /* TS_FUZZ_H */
