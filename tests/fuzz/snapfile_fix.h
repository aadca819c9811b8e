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

/* Rehash the piece p[off..off+n) into the 8 bytes after it and chain it; 0, or -1 past len. */
static inline int snapfix_piece(uint8_t *p, size_t len, size_t *off, uint64_t n, uint64_t *acc)
{
    if (n > len - *off || len - *off - n < 8)
        return -1;
    uint64_t h = tsd_hash64(p + *off, (size_t)n, 0);
    ts__put_u64le(p + *off + n, h);
    *acc = snapfix_chain(*acc, h);
    *off += (size_t)n + 8;
    return 0;
}

/* The streams section of format 2 from off: rewrite its checksums. 0, or -1 past len. */
static inline int snapfix_streams(uint8_t *p, size_t len, size_t *off, uint64_t *acc)
{
    if (len - *off < TSD_SNAP_SEC_SIZE)
        return -1;
    uint64_t n_streams = ts__get_u64le(p + *off + 8);
    if (snapfix_piece(p, len, off, 32, acc) != 0)
        return -1;
    for (uint64_t s = 0; s < n_streams; s++) {
        if (len - *off < 49 || len - *off - 49 < p[*off])
            return -1;
        size_t nl = p[*off];
        const uint8_t *q = p + *off + 1 + nl;
        uint32_t n_groups = ts__get_u32le(q + 28);
        uint64_t first = ts__get_u64le(q + 32), last = ts__get_u64le(q + 40);
        if (snapfix_piece(p, len, off, 49 + nl, acc) != 0 || last == UINT64_MAX ||
            last + 1 < first || (last + 1 - first) > (len - *off) / TSD_SNAP_ENTRY_SIZE)
            return -1;
        uint64_t n = last + 1 - first;
        const uint8_t *table = p + *off;
        if (snapfix_piece(p, len, off, n * TSD_SNAP_ENTRY_SIZE, acc) != 0)
            return -1;
        for (uint64_t k = 0; k < n; k++) {
            uint64_t rl = ts__get_u64le(table + k * TSD_SNAP_ENTRY_SIZE);
            if (rl != 0 && snapfix_piece(p, len, off, rl, acc) != 0)
                return -1;
        }
        for (uint32_t g = 0; g < n_groups; g++) {
            if (len - *off < 25 || len - *off - 25 < p[*off])
                return -1;
            size_t gl = p[*off];
            uint32_t n_members = ts__get_u32le(p + *off + 1 + gl + 20);
            if (snapfix_piece(p, len, off, 25 + gl, acc) != 0)
                return -1;
            for (uint32_t m = 0; m < n_members; m++) {
                if (len - *off < 9 || len - *off - 9 < p[*off])
                    return -1;
                size_t ml = p[*off];
                uint32_t n_pend = ts__get_u32le(p + *off + 1 + ml);
                if (snapfix_piece(p, len, off, 9 + ml, acc) != 0 ||
                    snapfix_piece(p, len, off, (uint64_t)n_pend * TSD_SNAP_PEND_SIZE, acc) != 0)
                    return -1;
            }
        }
    }
    return 0;
}

/* The replay tables section of format 3 from off: rewrite its checksums. 0, or -1 past len. */
static inline int snapfix_tables(uint8_t *p, size_t len, size_t *off, uint64_t *acc)
{
    if (len - *off < TSD_SNAP_SEC_SIZE)
        return -1;
    uint64_t n_tables = ts__get_u64le(p + *off + 8);
    if (snapfix_piece(p, len, off, 32, acc) != 0)
        return -1;
    for (uint64_t t = 0; t < n_tables; t++) {
        /* name_len, the name, 88 bytes of settings and counters (n_items last) */
        if (len - *off < 89 || len - *off - 89 < p[*off])
            return -1;
        size_t nl = p[*off];
        uint64_t n_items = ts__get_u64le(p + *off + 1 + nl + 80);
        if (snapfix_piece(p, len, off, 89 + nl, acc) != 0)
            return -1;
        if (n_items > (len - *off) / TSD_SNAP_TITEM_SIZE)
            return -1;
        const uint8_t *rows = p + *off;
        if (snapfix_piece(p, len, off, n_items * TSD_SNAP_TITEM_SIZE, acc) != 0)
            return -1;
        for (uint64_t k = 0; k < n_items; k++)
            if (snapfix_piece(p, len, off, ts__get_u64le(rows + k * TSD_SNAP_TITEM_SIZE + 16),
                              acc) != 0)
                return -1;
    }
    return 0;
}

/* The parameter server section of format 4 from off: rewrite its checksums. 0, or -1 past len. */
static inline int snapfix_ps(uint8_t *p, size_t len, size_t *off, uint64_t *acc)
{
    if (len - *off < TSD_SNAP_SEC_SIZE)
        return -1;
    uint64_t n_params = ts__get_u64le(p + *off + 8), n_embs = ts__get_u64le(p + *off + 16);
    if (snapfix_piece(p, len, off, 32, acc) != 0)
        return -1;
    for (uint64_t k = 0; k < n_params; k++) {
        /* name_len, the name, 80 bytes: optimizer at 0, ring_n at 12, numel at 48 */
        if (len - *off < 81 || len - *off - 81 < p[*off])
            return -1;
        const uint8_t *q = p + *off + 1 + p[*off];
        uint32_t slots = tsd_snapfile_slots(q[0]), ring_n = ts__get_u32le(q + 12);
        uint64_t numel = ts__get_u64le(q + 48);
        if (snapfix_piece(p, len, off, 81 + (size_t)p[*off], acc) != 0 ||
            snapfix_piece(p, len, off, (uint64_t)ring_n * TSD_SNAP_RING_SIZE, acc) != 0)
            return -1;
        for (uint32_t i = 0; i < slots; i++)
            if (numel > (len - *off) / 4 || snapfix_piece(p, len, off, numel * 4, acc) != 0)
                return -1;
    }
    for (uint64_t k = 0; k < n_embs; k++) {
        /* name_len, the name, 80 bytes: dim at 0, optimizer at 4, n_rows at 72 */
        if (len - *off < 81 || len - *off - 81 < p[*off])
            return -1;
        const uint8_t *q = p + *off + 1 + p[*off];
        uint64_t dim = ts__get_u32le(q), n = ts__get_u64le(q + 72);
        uint8_t opt = q[4];
        if (snapfix_piece(p, len, off, 81 + (size_t)p[*off], acc) != 0 || n > (len - *off) / 8 ||
            dim > (len - *off) || snapfix_piece(p, len, off, n * 8, acc) != 0 ||
            n * dim > (len - *off) / 4 ||
            snapfix_piece(p, len, off, n * dim * (1 + tsd_snapfile_slots(opt)) * 4, acc) != 0 ||
            (opt == TS_PS_OPT_ADAM && snapfix_piece(p, len, off, n * 4, acc) != 0))
            return -1;
    }
    return 0;
}

/*
 * Rewrite the checksums of p[0..len): the header's, each bin's and item's, in format 2 the
 * streams section's (its header, each stream's pieces), in format 3 the replay tables section's,
 * in format 4 the parameter server section's, the trailer's.
 */
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
    if (ts__get_u32le(p + 8) >= 2 && snapfix_streams(p, len, &off, &acc) != 0)
        return;
    if (ts__get_u32le(p + 8) >= 3 && snapfix_tables(p, len, &off, &acc) != 0)
        return;
    if (ts__get_u32le(p + 8) >= 4 && snapfix_ps(p, len, &off, &acc) != 0)
        return;
    if (len - off < TSD_SNAP_END_SIZE)
        return;
    ts__put_u64le(p + off + 24, snapfix_chain(acc, tsd_hash64(p + off, 24, 0)));
}

#endif /* TS_SNAPFILE_FIX_H */
