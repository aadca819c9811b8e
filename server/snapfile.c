/*
 * The snapshot file format: the checksum, the writer and the reader (see snapfile.h). The jobs
 * that decide when to write and what goes in, and that link a loaded file into the store, are
 * in snapshot.c.
 *
 * The file (all integers little-endian):
 *   header, 64 bytes:
 *      0 u8[8] magic "TSDSNAP\0"     8 u32 format (1)        12 u32 0
 *     16 u64 change counter          24 u64 bins             32 u64 items
 *     40 u64 record bytes            48 u64 wall clock, ms   56 u64 hash of bytes 0..55
 *   then per bin, in name order:
 *     u8 name_len, name, u64 version, u32 n_items, u32 0, n_items x u64 item length,
 *     u64 hash of the bin header so far;
 *     then per item: its record bytes, u64 hash of them
 *   trailer, 32 bytes:
 *      0 u8[8] magic "TSDSEND\0"     8 u64 bins              16 u64 items
 *     24 u64 hash of every section hash above, in order, and of bytes 0..23
 * Every byte is covered by a hash. The reader checks every length against the bytes left in the
 * file before it reads or allocates anything, so a damaged length can neither make it read out
 * of bounds nor ask for more memory than the file holds; the file must end right after the
 * trailer.
 */
#include "snapfile.h"

#include "record.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SNAP_MAGIC     "TSDSNAP"
#define SNAP_END_MAGIC "TSDSEND"
#define SNAP_WBUF      ((size_t)1 << 20) /* bytes; the writer's buffer for small pieces */
/* Bytes handed to one read() or write() call: Linux moves at most about 2 GiB per call. */
#define SNAP_IO_MAX ((size_t)1 << 30)
/* Bytes of a bin header without its name and item lengths: name_len, version, count, 0. */
#define SNAP_BIN_FIXED 17
/* Bytes a bin takes at least: its fixed header and its hash (an empty name, no items). */
#define SNAP_BIN_MIN (SNAP_BIN_FIXED + 8)
/* Bytes an item takes at least: its length, a record header and its hash. */
#define SNAP_ITEM_MIN (8 + TS_REC_HDR_SIZE + 8)
/* Bytes of a bin name in a message: each byte may become up to 4 (a UTF-8 sequence). */
#define SNAP_NAME_MSG (TS_MAX_NAME_LEN * 4 + 1)

_Static_assert(TS_MAX_NAME_LEN <= UINT8_MAX, "a bin name's length is one byte in the file");
_Static_assert(sizeof(SNAP_MAGIC) == 8 && sizeof(SNAP_END_MAGIC) == 8, "magics are 8 bytes");

/* ---------------------------------------------------------------------------------------------
 * The hash: xxHash64's structure (four lanes of multiply-rotate rounds, a final avalanche), so
 * that checking a multi-gigabyte snapshot costs a fraction of reading it.
 */
static const uint64_t P1 = 0x9E3779B185EBCA87ull;
static const uint64_t P2 = 0xC2B2AE3D27D4EB4Full;
static const uint64_t P3 = 0x165667B19E3779F9ull;
static const uint64_t P4 = 0x85EBCA77C2B2AE63ull;
static const uint64_t P5 = 0x27D4EB2F165667C5ull;

static inline uint64_t rotl64(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t h_round(uint64_t acc, uint64_t in)
{
    acc += in * P2;
    acc = rotl64(acc, 31);
    return acc * P1;
}

static inline uint64_t h_merge(uint64_t acc, uint64_t v)
{
    acc ^= h_round(0, v);
    return acc * P1 + P4;
}

uint64_t tsd_hash64(const void *data, size_t len, uint64_t seed)
{
    const uint8_t *p = data;
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const uint8_t *limit = end - 32;
        do {
            v1 = h_round(v1, ts__get_u64le(p));
            v2 = h_round(v2, ts__get_u64le(p + 8));
            v3 = h_round(v3, ts__get_u64le(p + 16));
            v4 = h_round(v4, ts__get_u64le(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = h_merge(h, v1);
        h = h_merge(h, v2);
        h = h_merge(h, v3);
        h = h_merge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= h_round(0, ts__get_u64le(p));
        h = rotl64(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)ts__get_u32le(p) * P1;
        h = rotl64(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P5;
        h = rotl64(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* The trailer's running hash: fold one section hash in. */
static uint64_t chain(uint64_t acc, uint64_t h)
{
    uint8_t b[16];
    ts__put_u64le(b, acc);
    ts__put_u64le(b + 8, h);
    return tsd_hash64(b, sizeof(b), 0);
}

/* ---------------------------------------------------------------------------------------------
 * Writing
 */

static int bin_cmp(const void *a, const void *b)
{
    const tsd_snapfile_bin *x = a;
    const tsd_snapfile_bin *y = b;
    size_t n = x->name_len < y->name_len ? x->name_len : y->name_len;
    int r = n > 0 ? memcmp(x->name, y->name, n) : 0;
    if (r != 0)
        return r;
    return (x->name_len > y->name_len) - (x->name_len < y->name_len);
}

void tsd_snapfile_sort(tsd_snapfile_bin *bins, size_t n)
{
    if (n > 1)
        qsort(bins, n, sizeof(*bins), bin_cmp);
}

typedef struct snap_writer {
    int fd;
    uint8_t *buf;
    size_t len;
    int err; /* 0, or the negated errno of the first failure; nothing is written after one */
} snap_writer;

/* Write all bytes, retrying short writes and EINTR. 0 or a negated errno. */
static int write_all(int fd, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t w = write(fd, p, n > SNAP_IO_MAX ? SNAP_IO_MAX : n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0)
            return -errno;
        if (w == 0)
            return -EIO; /* a regular file that takes nothing: treat it as an I/O error */
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static void w_flush(snap_writer *w)
{
    if (w->err != 0 || w->len == 0)
        return;
    w->err = write_all(w->fd, w->buf, w->len);
    w->len = 0;
}

/*
 * Append bytes: small ones are gathered in the buffer, large ones go straight out, after what
 * the buffer holds (a piece of half the buffer or more that still fitted beside it once went
 * out first, which put a record ahead of its own bin header in the file).
 */
static void w_put(snap_writer *w, const void *p, size_t n)
{
    if (w->err != 0)
        return;
    if (n >= SNAP_WBUF / 2 || w->len + n > SNAP_WBUF) {
        w_flush(w);
        if (w->err != 0)
            return;
    }
    if (n >= SNAP_WBUF / 2) {
        w->err = write_all(w->fd, p, n);
        return;
    }
    if (n > 0)
        memcpy(w->buf + w->len, p, n);
    w->len += n;
}

static void w_u64(snap_writer *w, uint64_t v)
{
    uint8_t b[8];
    ts__put_u64le(b, v);
    w_put(w, b, 8);
}

int tsd_snapfile_write(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                       tsd_snapfile_item_fn item, void *arg)
{
    snap_writer w = {.fd = fd};
    w.buf = ts__malloc(SNAP_WBUF);
    if (w.buf == NULL)
        return -ENOMEM;

    uint8_t hdr[TSD_SNAP_HDR_SIZE];
    memset(hdr, 0, sizeof(hdr));
    memcpy(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC));
    ts__put_u32le(hdr + 8, TSD_SNAP_FORMAT);
    ts__put_u64le(hdr + 16, head->counter);
    ts__put_u64le(hdr + 24, head->n_bins);
    ts__put_u64le(hdr + 32, head->n_items);
    ts__put_u64le(hdr + 40, head->bytes);
    ts__put_u64le(hdr + 48, head->wall_ms);
    uint64_t h = tsd_hash64(hdr, 56, 0);
    ts__put_u64le(hdr + 56, h);
    w_put(&w, hdr, sizeof(hdr));
    uint64_t acc = chain(0, h);

    /* The bin header's fixed part plus the largest item list, hashed as one piece. */
    uint8_t *bh = NULL;
    size_t bh_cap = 0;
    for (size_t b = 0; b < head->n_bins && w.err == 0; b++) {
        const tsd_snapfile_bin *sb = &bins[b];
        size_t need = SNAP_BIN_FIXED + (size_t)sb->name_len + (size_t)sb->n_items * 8;
        if (need > bh_cap) {
            uint8_t *nb = ts__realloc(bh, need);
            if (nb == NULL) {
                w.err = -ENOMEM;
                break;
            }
            bh = nb;
            bh_cap = need;
        }
        uint8_t *p = bh;
        *p++ = sb->name_len;
        if (sb->name_len > 0)
            memcpy(p, sb->name, sb->name_len);
        p += sb->name_len;
        ts__put_u64le(p, sb->version);
        ts__put_u32le(p + 8, sb->n_items);
        ts__put_u32le(p + 12, 0);
        p += 16;
        for (uint32_t i = 0; i < sb->n_items; i++, p += 8) {
            const uint8_t *data;
            size_t len;
            item(arg, sb->first + i, &data, &len);
            ts__put_u64le(p, len);
        }
        h = tsd_hash64(bh, need, 0);
        w_put(&w, bh, need);
        w_u64(&w, h);
        acc = chain(acc, h);
        for (uint32_t i = 0; i < sb->n_items; i++) {
            const uint8_t *data;
            size_t len;
            item(arg, sb->first + i, &data, &len);
            h = tsd_hash64(data, len, 0);
            w_put(&w, data, len);
            w_u64(&w, h);
            acc = chain(acc, h);
        }
    }
    ts__free(bh);

    uint8_t end[TSD_SNAP_END_SIZE];
    memcpy(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC));
    ts__put_u64le(end + 8, head->n_bins);
    ts__put_u64le(end + 16, head->n_items);
    ts__put_u64le(end + 24, chain(acc, tsd_hash64(end, 24, 0)));
    w_put(&w, end, sizeof(end));
    w_flush(&w);
    ts__free(w.buf);
    return w.err;
}

/* ---------------------------------------------------------------------------------------------
 * Reading
 */

typedef struct snap_reader {
    int fd;             /* the file, or -1 when reading mem */
    const uint8_t *mem; /* the file's bytes, when reading from memory */
    uint64_t left;      /* bytes of the file not yet read */
    const char *label;
    const tsd_snapfile_sink *sink;
    char *err;
    size_t err_cap;
    int rc; /* what the reader returns when it fails */
} snap_reader;

static void fail(snap_reader *r, int rc, const char *kind, const char *fmt, va_list ap)
{
    char msg[600];
    vsnprintf(msg, sizeof(msg), fmt, ap);
    snprintf(r->err, r->err_cap, "snapshot %s%s%s", r->label, kind, msg);
    r->rc = rc;
}

/* Something the file says is wrong. -1. */
static int bad(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int bad(snap_reader *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, TS_EPROTO, " is damaged: ", fmt, ap);
    va_end(ap);
    return -1;
}

/* A length that points past the end: the file was cut short, or a length was damaged. -1. */
static int cut(snap_reader *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int cut(snap_reader *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, TS_EPROTO, " is truncated or damaged: ", fmt, ap);
    va_end(ap);
    return -1;
}

/* Anything else: out of memory, a failed read. -1. */
static int other(snap_reader *r, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int other(snap_reader *r, int rc, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fail(r, rc, ": ", fmt, ap);
    va_end(ap);
    return -1;
}

/* Read exactly n bytes; -1 with a message naming what was being read. */
static int r_read(snap_reader *r, void *dst, size_t n, const char *what)
{
    if (n > r->left) {
        snprintf(r->err, r->err_cap,
                 "snapshot %s is truncated: %s needs %zu bytes, only %llu remain", r->label, what,
                 n, (unsigned long long)r->left);
        r->rc = TS_EPROTO;
        return -1;
    }
    if (r->mem != NULL) {
        if (n > 0)
            memcpy(dst, r->mem, n);
        r->mem += n;
        r->left -= n;
        return 0;
    }
    uint8_t *p = dst;
    size_t got = 0;
    while (got < n) {
        ssize_t k = read(r->fd, p + got, n - got > SNAP_IO_MAX ? SNAP_IO_MAX : n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            return other(r, -errno, "reading %s: %s", what, strerror(errno));
        if (k == 0) /* the file shrank since its size was taken */
            return other(r, TS_EPROTO, "reading %s: unexpected end of file", what);
        got += (size_t)k;
    }
    r->left -= n;
    return 0;
}

/* name as it appears in messages. */
static void printable(const snap_reader *r, const uint8_t *name, size_t len, char *out, size_t cap)
{
    if (r->sink->name_printable != NULL) {
        r->sink->name_printable(name, len, out, cap);
        return;
    }
    size_t o = 0;
    for (size_t i = 0; i < len && o + 1 < cap; i++)
        out[o++] = name[i] >= 0x20 && name[i] < 0x7F ? (char)name[i] : '?';
    out[o] = '\0';
}

/* What the reader has met so far, checked against the header at the end. */
typedef struct snap_count {
    uint64_t items_total; /* the header's item count */
    uint64_t items_seen;
    uint64_t bytes_seen;
    uint64_t acc; /* the trailer's running hash */
    uint8_t *hb;  /* the current bin's header, grown as needed */
    size_t hb_cap;
} snap_count;

/* Read and check one bin (header, item lengths, items), handing it to the sink. 0 or -1. */
static int read_bin(snap_reader *r, snap_count *c, uint64_t index)
{
    uint8_t fixed[SNAP_BIN_FIXED + TS_MAX_NAME_LEN];
    char what[64];
    snprintf(what, sizeof(what), "the header of bin %llu", (unsigned long long)index);
    if (r_read(r, fixed, 1, what) != 0)
        return -1;
    size_t nl = fixed[0];
    if (r_read(r, fixed + 1, nl + 16, what) != 0)
        return -1;
    uint32_t n = ts__get_u32le(fixed + 1 + nl + 8);
    /*
     * Each item needs its length, a record header and a hash, and the bin its own hash: check
     * before allocating the list.
     */
    if (n > c->items_total - c->items_seen || (uint64_t)n * SNAP_ITEM_MIN + 8 > r->left)
        return cut(r, "bin %llu claims %u items, more than the rest of the file can hold",
                   (unsigned long long)index, n);
    size_t hlen = SNAP_BIN_FIXED + nl + (size_t)n * 8;
    if (hlen > c->hb_cap) {
        uint8_t *nb = ts__realloc(c->hb, hlen);
        if (nb == NULL)
            return other(r, TS_ENOMEM, "out of memory loading it");
        c->hb = nb;
        c->hb_cap = hlen;
    }
    uint8_t *hb = c->hb;
    memcpy(hb, fixed, SNAP_BIN_FIXED + nl);
    uint8_t hash[8];
    if (r_read(r, hb + SNAP_BIN_FIXED + nl, (size_t)n * 8, what) != 0 ||
        r_read(r, hash, 8, what) != 0)
        return -1;
    uint64_t h = tsd_hash64(hb, hlen, 0);
    if (h != ts__get_u64le(hash))
        return bad(r, "checksum mismatch in the header of bin %llu", (unsigned long long)index);
    if (ts__get_u32le(hb + 1 + nl + 12) != 0)
        return bad(r, "bin %llu: a reserved field is not 0", (unsigned long long)index);
    c->acc = chain(c->acc, h);
    const uint8_t *name = hb + 1;
    uint64_t version = ts__get_u64le(hb + 1 + nl);
    char pn[SNAP_NAME_MSG];
    printable(r, name, nl, pn, sizeof(pn));
    /* The whole item list first: no allocation for a bin whose lengths cannot all fit. */
    uint64_t need = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = ts__get_u64le(hb + SNAP_BIN_FIXED + nl + (size_t)i * 8);
        if (len > r->left || len < TS_REC_HDR_SIZE || len + 8 > r->left - need)
            return cut(r, "item %u of bin '%s' claims %llu bytes (%llu remain in the file)", i, pn,
                       (unsigned long long)len, (unsigned long long)(r->left - need));
        need += len + 8;
    }
    if (r->sink->bin(r->sink->arg, name, nl, version, n) != 0)
        return other(r, TS_ENOMEM, "out of memory loading it");
    for (uint32_t i = 0; i < n; i++) {
        size_t len = (size_t)ts__get_u64le(hb + SNAP_BIN_FIXED + nl + (size_t)i * 8);
        uint8_t *data = r->sink->item(r->sink->arg, len);
        if (data == NULL)
            return other(r, TS_ENOMEM, "out of memory loading a %zu-byte item", len);
        snprintf(what, sizeof(what), "item %u of bin %llu", i, (unsigned long long)index);
        if (r_read(r, data, len, what) != 0 || r_read(r, hash, 8, what) != 0)
            return -1;
        h = tsd_hash64(data, len, 0);
        if (h != ts__get_u64le(hash))
            return bad(r, "checksum mismatch in item %u of bin '%s'", i, pn);
        /* The validator and limits a PUT of this record meets. */
        if (ts__record_validate(data, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0)
            return bad(r, "item %u of bin '%s' is not a valid record", i, pn);
        c->acc = chain(c->acc, h);
        c->items_seen++;
        c->bytes_seen += len;
    }
    return 0;
}

static int read_all(snap_reader *r, tsd_snapfile_head *out)
{
    uint8_t hdr[TSD_SNAP_HDR_SIZE];
    if (r_read(r, hdr, sizeof(hdr), "the file header") != 0)
        return -1;
    if (memcmp(hdr, SNAP_MAGIC, sizeof(SNAP_MAGIC)) != 0)
        return bad(r, "not a tensord snapshot (bad magic)");
    if (tsd_hash64(hdr, 56, 0) != ts__get_u64le(hdr + 56))
        return bad(r, "checksum mismatch in the file header");
    if (ts__get_u32le(hdr + 8) != TSD_SNAP_FORMAT) {
        snprintf(r->err, r->err_cap,
                 "snapshot %s: format %u is not supported (this tensord reads %d)", r->label,
                 ts__get_u32le(hdr + 8), TSD_SNAP_FORMAT);
        r->rc = TS_EPROTO;
        return -1;
    }
    if (ts__get_u32le(hdr + 12) != 0)
        return bad(r, "a reserved field of the file header is not 0");
    tsd_snapfile_head head = {
        .counter = ts__get_u64le(hdr + 16),
        .n_bins = ts__get_u64le(hdr + 24),
        .n_items = ts__get_u64le(hdr + 32),
        .bytes = ts__get_u64le(hdr + 40),
        .wall_ms = ts__get_u64le(hdr + 48),
    };
    /* Each bin and each item takes a minimum number of bytes: both counts are bounded. */
    if (head.n_bins > r->left / SNAP_BIN_MIN || head.n_items > r->left / SNAP_ITEM_MIN)
        return cut(r, "the header claims %llu bins and %llu items, more than the file can hold",
                   (unsigned long long)head.n_bins, (unsigned long long)head.n_items);
    snap_count c = {.items_total = head.n_items, .acc = chain(0, ts__get_u64le(hdr + 56))};
    int rc = 0;
    for (uint64_t b = 0; b < head.n_bins && rc == 0; b++)
        rc = read_bin(r, &c, b);
    ts__free(c.hb);
    if (rc != 0)
        return -1;
    uint8_t end[TSD_SNAP_END_SIZE];
    if (r_read(r, end, sizeof(end), "the trailer") != 0)
        return -1;
    if (memcmp(end, SNAP_END_MAGIC, sizeof(SNAP_END_MAGIC)) != 0 ||
        ts__get_u64le(end + 8) != head.n_bins || ts__get_u64le(end + 16) != head.n_items ||
        c.items_seen != head.n_items)
        return bad(r, "the trailer does not match the contents");
    if (chain(c.acc, tsd_hash64(end, 24, 0)) != ts__get_u64le(end + 24))
        return bad(r, "checksum mismatch in the trailer");
    if (c.bytes_seen != head.bytes)
        return bad(r, "the header claims %llu record bytes, the items hold %llu",
                   (unsigned long long)head.bytes, (unsigned long long)c.bytes_seen);
    if (r->left != 0)
        return bad(r, "%llu unexpected bytes after the trailer", (unsigned long long)r->left);
    *out = head;
    return 0;
}

int tsd_snapfile_read_fd(int fd, uint64_t size, const char *label, const tsd_snapfile_sink *sink,
                         tsd_snapfile_head *head, char *err, size_t err_cap)
{
    snap_reader r = {.fd = fd,
                     .left = size,
                     .label = label,
                     .sink = sink,
                     .err = err,
                     .err_cap = err_cap,
                     .rc = TS_EPROTO};
    return read_all(&r, head) == 0 ? 0 : r.rc;
}

int tsd_snapfile_read_mem(const uint8_t *p, size_t len, const char *label,
                          const tsd_snapfile_sink *sink, tsd_snapfile_head *head, char *err,
                          size_t err_cap)
{
    /* A non-NULL base even for an empty file, so r_read knows it reads memory. */
    static const uint8_t empty[1];
    snap_reader r = {.fd = -1,
                     .mem = p != NULL ? p : empty,
                     .left = len,
                     .label = label,
                     .sink = sink,
                     .err = err,
                     .err_cap = err_cap,
                     .rc = TS_EPROTO};
    return read_all(&r, head) == 0 ? 0 : r.rc;
}
