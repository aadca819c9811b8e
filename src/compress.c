/* lz4 block compression of frame bodies. */
#include "compress.h"

#include <lz4.h>

_Static_assert(TS_LZ4_MAX_RAW == LZ4_MAX_INPUT_SIZE, "the protocol's raw limit is lz4's own");

size_t ts__lz4_bound(size_t len)
{
    if (len > LZ4_MAX_INPUT_SIZE)
        return 0;
    return TS_LZ4_PREFIX + (size_t)LZ4_compressBound((int)len);
}

int ts__lz4_compress(const void *src, size_t len, uint8_t *dst, size_t dst_cap, size_t *out_len)
{
    if (len > LZ4_MAX_INPUT_SIZE || dst_cap < TS_LZ4_PREFIX)
        return TS_EINVAL;
    size_t cap = dst_cap - TS_LZ4_PREFIX;
    if (cap > (size_t)INT32_MAX)
        cap = INT32_MAX;
    int n = LZ4_compress_default(src, (char *)dst + TS_LZ4_PREFIX, (int)len, (int)cap);
    if (n <= 0)
        return TS_EAGAIN;
    size_t total = TS_LZ4_PREFIX + (size_t)n;
    if (total > len - len / 16)
        return TS_EAGAIN;
    ts__put_u64le(dst, len);
    *out_len = total;
    return 0;
}

int ts__lz4_raw_len(const uint8_t *body, size_t len, uint64_t *raw_len)
{
    if (len < TS_LZ4_PREFIX)
        return TS_EPROTO;
    *raw_len = ts__get_u64le(body);
    return 0;
}

int ts__lz4_decompress(const uint8_t *body, size_t len, uint8_t *dst, size_t dst_len)
{
    uint64_t raw;
    if (ts__lz4_raw_len(body, len, &raw) != 0 || raw != dst_len || dst_len > LZ4_MAX_INPUT_SIZE ||
        len - TS_LZ4_PREFIX > (size_t)INT32_MAX)
        return TS_EPROTO;
    int n = LZ4_decompress_safe((const char *)body + TS_LZ4_PREFIX, (char *)dst,
                                (int)(len - TS_LZ4_PREFIX), (int)dst_len);
    if (n < 0 || (size_t)n != dst_len)
        return TS_EPROTO;
    return 0;
}
