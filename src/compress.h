/*
 * lz4 framing for compressed frame bodies. A compressed body is u64 raw_len followed by one LZ4
 * block that decompresses to exactly raw_len bytes.
 */
#ifndef TS_COMPRESS_H
#define TS_COMPRESS_H

#include "common.h"

#define TS_LZ4_PREFIX 8 /* bytes: the u64 raw length */
/* Bytes; the largest raw length of a compressed body (LZ4_MAX_INPUT_SIZE, LZ4's own limit). */
#define TS_LZ4_MAX_RAW ((uint64_t)0x7E000000)

/* Largest compressed body for len raw bytes (prefix included), 0 when len is too large. */
size_t ts__lz4_bound(size_t len);

/*
 * Compress src into dst (capacity dst_cap >= ts__lz4_bound(len)). Returns 0 and the body size, or
 * TS_EAGAIN when the result would not save at least 1/16 of the input (send it raw), TS_EINVAL
 * for inputs lz4 cannot take.
 */
int ts__lz4_compress(const void *src, size_t len, uint8_t *dst, size_t dst_cap, size_t *out_len);

/* The raw length a compressed body announces; TS_EPROTO when the body is too short. */
int ts__lz4_raw_len(const uint8_t *body, size_t len, uint64_t *raw_len);

/*
 * Decompress a body into dst, which must hold exactly the announced raw length. TS_EPROTO when
 * the block is malformed or does not decompress to exactly that length.
 */
int ts__lz4_decompress(const uint8_t *body, size_t len, uint8_t *dst, size_t dst_len);

#endif /* TS_COMPRESS_H */
