/*
 * Fuzz target: the lz4 body framing. The input is used twice: as a compressed body (u64 raw
 * length + one LZ4 block) to decompress, and as raw bytes to compress and decompress again.
 */
#include "fuzz.h"

#include "compress.h"

/*
 * Raw lengths the target is willing to allocate. A receiver would check the announced length
 * against its frame limit the same way before allocating.
 */
#define FZ_MAX_RAW ((uint64_t)1 << 22)

/* Decompress the input as a body; the announced length must be honoured exactly. */
static void as_body(const uint8_t *data, size_t size)
{
    uint64_t raw;
    int rc = ts__lz4_raw_len(data, size, &raw);
    if (rc != 0) {
        FZ_CHECK(rc == TS_EPROTO && size < TS_LZ4_PREFIX);
        uint8_t dst[1];
        FZ_CHECK(ts__lz4_decompress(data, size, dst, 0) == TS_EPROTO);
        return;
    }
    if (raw > FZ_MAX_RAW)
        return;
    uint8_t *dst = ts__malloc((size_t)raw + 1);
    FZ_CHECK(dst != NULL);
    rc = ts__lz4_decompress(data, size, dst, (size_t)raw);
    FZ_CHECK(rc == 0 || rc == TS_EPROTO);
    /* A destination of any other length is refused, whatever the block holds. */
    FZ_CHECK(ts__lz4_decompress(data, size, dst, (size_t)raw + 1) == TS_EPROTO);
    if (raw > 0)
        FZ_CHECK(ts__lz4_decompress(data, size, dst, (size_t)raw - 1) == TS_EPROTO);
    if (rc == 0) {
        /* What decompressed once decompresses the same way again. */
        uint8_t *again = ts__malloc((size_t)raw + 1);
        FZ_CHECK(again != NULL);
        FZ_CHECK(ts__lz4_decompress(data, size, again, (size_t)raw) == 0);
        FZ_CHECK(raw == 0 || memcmp(dst, again, (size_t)raw) == 0);
        ts__free(again);
    }
    ts__free(dst);
}

/* Compress the input; when that is worth it, the body must decompress to the input. */
static void as_raw(const uint8_t *data, size_t size)
{
    size_t cap = ts__lz4_bound(size);
    FZ_CHECK(cap > TS_LZ4_PREFIX);
    uint8_t *body = ts__malloc(cap);
    FZ_CHECK(body != NULL);
    size_t blen = 0;
    int rc = ts__lz4_compress(data, size, body, cap, &blen);
    FZ_CHECK(rc == 0 || rc == TS_EAGAIN);
    if (rc == 0) {
        FZ_CHECK(blen > TS_LZ4_PREFIX && blen <= size - size / 16);
        uint64_t raw;
        FZ_CHECK(ts__lz4_raw_len(body, blen, &raw) == 0 && raw == size);
        uint8_t *out = ts__malloc(size);
        FZ_CHECK(out != NULL);
        FZ_CHECK(ts__lz4_decompress(body, blen, out, size) == 0);
        FZ_CHECK(memcmp(out, data, size) == 0);
        /* Any truncation of a valid body is refused. */
        FZ_CHECK(ts__lz4_decompress(body, blen - 1, out, size) == TS_EPROTO);
        ts__free(out);
    }
    ts__free(body);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    as_body(data, size);
    as_raw(data, size);
    return 0;
}
