/*
 * Test support for the snapshot format (server/snapfile.c): recompute every checksum of a
 * snapshot image in place, walking its layout as far as its own lengths allow. A mutated or
 * hand-built file then gets past the checksums, so the fuzz target and the unit test reach the
 * checks behind them (counts, lengths, records). Header-only: both include it.
 */
#ifndef TS_SNAPFILE_FIX_H
#define TS_SNAPFILE_FIX_H

#include "snapfile.h"

/* The trailer's running hash, as the format defines it. */
static inline uint64_t snapfix_chain(uint64_t acc, uint64_t h)
{
    uint8_t b[16];
    ts__put_u64le(b, acc);
    ts__put_u64le(b + 8, h);
    return tsd_hash64(b, sizeof(b), 0);
}

/* Rewrite the checksums of p[0..len): the header's, each bin's and item's, the trailer's. */
static inline void snapfix_rehash(uint8_t *p, size_t len)
{
    if (len < TSD_SNAP_HDR_SIZE)
        return;
    uint64_t h = tsd_hash64(p, 56, 0);
    ts__put_u64le(p + 56, h);
    uint64_t acc = snapfix_chain(0, h);
    uint64_t n_bins = ts__get_u64le(p + 24);
    size_t off = TSD_SNAP_HDR_SIZE;
    for (uint64_t b = 0; b < n_bins; b++) {
        if (len - off < 17 || len - off - 17 < p[off])
            return;
        size_t nl = p[off];
        uint32_t n = ts__get_u32le(p + off + 1 + nl + 8);
        if ((len - off - 17 - nl) / 8 < n)
            return;
        size_t hl = 17 + nl + (size_t)n * 8;
        if (len - off - hl < 8)
            return;
        const uint8_t *lens = p + off + 17 + nl;
        h = tsd_hash64(p + off, hl, 0);
        ts__put_u64le(p + off + hl, h);
        acc = snapfix_chain(acc, h);
        off += hl + 8;
        for (uint32_t i = 0; i < n; i++) {
            uint64_t il = ts__get_u64le(lens + (size_t)i * 8);
            if (il > len - off || len - off - il < 8)
                return;
            h = tsd_hash64(p + off, (size_t)il, 0);
            ts__put_u64le(p + off + il, h);
            acc = snapfix_chain(acc, h);
            off += (size_t)il + 8;
        }
    }
    if (len - off < TSD_SNAP_END_SIZE)
        return;
    ts__put_u64le(p + off + 24, snapfix_chain(acc, tsd_hash64(p + off, 24, 0)));
}

#endif /* TS_SNAPFILE_FIX_H */
