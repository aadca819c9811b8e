/*
 * Slots and shard maps (slot.h): the CRC, the hash tags, the default split, the map built from
 * an owner table, and the map file parser. Every way of making a map ends in map_build, which
 * derives the ranges from the owner table, so a map read from a file, a split or a SHARD_MAP
 * reply is the same structure with the same canonical ranges.
 */
#include "slot.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common.h"

_Static_assert((TS_SLOTS & (TS_SLOTS - 1)) == 0, "the slot mask needs a power of two");
_Static_assert(TS_SHARD_MAX < TS_SHARD_NONE, "a shard index never reads as 'none'");
_Static_assert(TS_SLOTS <= 65536, "a slot is a u16 on the wire");

/*
 * CRC-16/XMODEM four bits at a time: entry i is the remainder of the nibble i at the top of the
 * register. Sixteen entries keep the table in one cache line while costing two lookups a byte.
 */
static const uint16_t crc_nibble[16] = {0x0000, 0x1021, 0x2042, 0x3063, 0x4084, 0x50A5,
                                        0x60C6, 0x70E7, 0x8108, 0x9129, 0xA14A, 0xB16B,
                                        0xC18C, 0xD1AD, 0xE1CE, 0xF1EF};

uint16_t ts__crc16_xmodem(const void *p, size_t len)
{
    const uint8_t *b = p;
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc = (uint16_t)((crc << 4) ^ crc_nibble[(crc >> 12) ^ (b[i] >> 4)]);
        crc = (uint16_t)((crc << 4) ^ crc_nibble[(crc >> 12) ^ (b[i] & 0x0F)]);
    }
    return crc;
}

uint16_t ts__slot(const void *name, size_t len)
{
    const uint8_t *b = name;
    const uint8_t *open = len > 0 ? memchr(b, '{', len) : NULL;
    if (open != NULL) {
        size_t start = (size_t)(open - b) + 1;
        const uint8_t *close = memchr(b + start, '}', len - start);
        /* "{}" (an empty tag) hashes the whole name, so it does not pile names on one slot. */
        if (close != NULL && close > b + start)
            return (uint16_t)(ts__crc16_xmodem(b + start, (size_t)(close - (b + start))) &
                              (TS_SLOTS - 1));
    }
    return (uint16_t)(ts__crc16_xmodem(b, len) & (TS_SLOTS - 1));
}

uint32_t ts__slot_split_first(uint32_t i, uint32_t n)
{
    /* i <= n <= 1024, so i * 16384 fits 32 bits. */
    return (uint32_t)(((uint64_t)i * TS_SLOTS) / n);
}

void ts__shard_map_free(ts__shard_map *m)
{
    if (m == NULL)
        return;
    if (m->addrs != NULL) {
        for (uint32_t i = 0; i < m->n_shards; i++)
            ts__free(m->addrs[i]);
        ts__free(m->addrs);
    }
    ts__free(m->range_off);
    ts__free(m->ranges);
    ts__free(m);
}

/*
 * Fill m's ranges from its owner table (m->n_shards set, m->owner filled): one pass counts each
 * shard's runs, a second writes them, sorted by slot within each shard. Returns 0, TS_EINVAL
 * when an owner is out of range or a shard owns no slot, or TS_ENOMEM.
 */
static int map_ranges(ts__shard_map *m)
{
    uint32_t n = m->n_shards;
    m->range_off = ts__calloc((size_t)n + 1, sizeof(*m->range_off));
    if (m->range_off == NULL)
        return TS_ENOMEM;
    uint32_t runs = 0;
    for (uint32_t s = 0; s < TS_SLOTS; s++) {
        if (m->owner[s] >= n)
            return TS_EINVAL;
        if (s == 0 || m->owner[s] != m->owner[s - 1]) {
            m->range_off[m->owner[s] + 1]++;
            runs++;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        if (m->range_off[i + 1] == 0)
            return TS_EINVAL;
        m->range_off[i + 1] += m->range_off[i];
    }
    m->ranges = ts__calloc(runs, sizeof(*m->ranges));
    uint32_t *next = ts__calloc(n, sizeof(*next));
    if (m->ranges == NULL || next == NULL) {
        ts__free(next);
        return TS_ENOMEM;
    }
    memcpy(next, m->range_off, (size_t)n * sizeof(*next));
    for (uint32_t s = 0; s < TS_SLOTS; s++) {
        uint16_t o = m->owner[s];
        if (s == 0 || o != m->owner[s - 1])
            m->ranges[next[o]++].first = (uint16_t)s;
        m->ranges[next[o] - 1].last = (uint16_t)s;
    }
    ts__free(next);
    m->n_ranges = runs;
    return 0;
}

/* A new map of n shards with every address "" (unknown); NULL when out of memory. */
static ts__shard_map *map_new(uint32_t n, uint64_t epoch)
{
    ts__shard_map *m = ts__calloc(1, sizeof(*m));
    if (m == NULL)
        return NULL;
    m->epoch = epoch;
    m->n_shards = n;
    m->addrs = ts__calloc(n, sizeof(*m->addrs));
    if (m->addrs == NULL) {
        ts__free(m);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        m->addrs[i] = ts__strndup("", 0);
        if (m->addrs[i] == NULL) {
            ts__shard_map_free(m);
            return NULL;
        }
    }
    return m;
}

/*
 * Replace shard i's address by len bytes of addr: 0, TS_EINVAL for an address that
 * ts__shard_addr_ok refuses (len 0 is "unknown"), or TS_ENOMEM.
 */
static int map_set_addr(ts__shard_map *m, uint32_t i, const char *addr, size_t len)
{
    if (len > 0 && !ts__shard_addr_ok(addr, len))
        return TS_EINVAL;
    char *copy = ts__strndup(addr, len);
    if (copy == NULL)
        return TS_ENOMEM;
    ts__free(m->addrs[i]);
    m->addrs[i] = copy;
    return 0;
}

int ts__shard_map_from_owners(uint32_t n, const uint16_t *owner, const char *const *addrs,
                              uint64_t epoch, ts__shard_map **out)
{
    if (n == 0 || n > TS_SHARD_MAX)
        return TS_EINVAL;
    ts__shard_map *m = map_new(n, epoch);
    if (m == NULL)
        return TS_ENOMEM;
    memcpy(m->owner, owner, sizeof(m->owner));
    int rc = map_ranges(m);
    for (uint32_t i = 0; rc == 0 && addrs != NULL && i < n; i++)
        rc = map_set_addr(m, i, addrs[i], strlen(addrs[i]));
    if (rc != 0) {
        ts__shard_map_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

/* Fill owner[] with the default split of n shards. */
static void split_default(uint16_t *owner, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t s = ts__slot_split_first(i, n); s < ts__slot_split_first(i + 1, n); s++)
            owner[s] = (uint16_t)i;
}

int ts__shard_map_default(uint32_t n, const char *const *addrs, uint64_t epoch, ts__shard_map **out)
{
    if (n == 0 || n > TS_SHARD_MAX)
        return TS_EINVAL;
    uint16_t *owner = ts__malloc(TS_SLOTS * sizeof(*owner));
    if (owner == NULL)
        return TS_ENOMEM;
    split_default(owner, n);
    int rc = ts__shard_map_from_owners(n, owner, addrs, epoch, out);
    ts__free(owner);
    return rc;
}

int ts__shard_map_same(const ts__shard_map *a, const ts__shard_map *b)
{
    if (a->n_shards != b->n_shards || memcmp(a->owner, b->owner, sizeof(a->owner)) != 0)
        return 0;
    for (uint32_t i = 0; i < a->n_shards; i++)
        if (strcmp(a->addrs[i], b->addrs[i]) != 0)
            return 0;
    return 1;
}

/* ---------------------------------------------------------------------------------------------
 * The map file
 */

/* The parser's state across lines. */
typedef struct map_parse {
    char *err;
    size_t err_cap;
    uint32_t line;        /* the current line, from 1 */
    uint64_t epoch;       /* 0 until an epoch line */
    uint32_t epoch_line;  /* the line of the epoch, for the duplicate's message */
    uint32_t n;           /* shard lines so far */
    int ranged;           /* -1 before the first shard line, then 0 or 1 */
    uint16_t *owner;      /* TS_SLOTS entries, TS_SHARD_NONE until a range takes the slot */
    uint32_t *shard_line; /* TS_SHARD_MAX entries: the line of each shard */
    const char *addr[TS_SHARD_MAX];
    size_t addr_len[TS_SHARD_MAX];
} map_parse;

/* Write "line N: <fmt>" into the error buffer and return TS_EINVAL. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static int
parse_fail(map_parse *ps, const char *fmt, ...)
{
    if (ps->err != NULL && ps->err_cap > 0) {
        int k = snprintf(ps->err, ps->err_cap, "line %" PRIu32 ": ", ps->line);
        if (k >= 0 && (size_t)k < ps->err_cap) {
            va_list ap;
            va_start(ap, fmt);
            (void)vsnprintf(ps->err + k, ps->err_cap - (size_t)k, fmt, ap);
            va_end(ap);
        }
    }
    return TS_EINVAL;
}

static int is_space(char c)
{
    return c == ' ' || c == '\t' || c == '\r';
}

/* The next whitespace-separated token of [*p, end): 1 and its bounds, or 0 at the end. */
static int next_token(const char **p, const char *end, const char **tok, size_t *len)
{
    const char *q = *p;
    while (q < end && is_space(*q))
        q++;
    if (q == end) {
        *p = q;
        return 0;
    }
    const char *start = q;
    while (q < end && !is_space(*q))
        q++;
    *tok = start;
    *len = (size_t)(q - start);
    *p = q;
    return 1;
}

/*
 * A decimal number of [*p, end) (at least one digit, no sign) up to max: 0 and *v with *p after
 * it, or -1 when there is no digit or it goes over max.
 */
static int parse_dec(const char **p, const char *end, uint64_t max, uint64_t *v)
{
    const char *q = *p;
    uint64_t x = 0;
    if (q == end || *q < '0' || *q > '9')
        return -1;
    while (q < end && *q >= '0' && *q <= '9') {
        if (__builtin_mul_overflow(x, 10, &x) ||
            __builtin_add_overflow(x, (uint64_t)(*q - '0'), &x))
            return -1;
        if (x > max)
            return -1;
        q++;
    }
    *p = q;
    *v = x;
    return 0;
}

static int parse_epoch(map_parse *ps, const char *tok, size_t len)
{
    const char *p = tok;
    uint64_t v = 0;
    if (ps->epoch_line != 0)
        return parse_fail(ps, "a second epoch line (the first is line %" PRIu32 ")",
                          ps->epoch_line);
    if (parse_dec(&p, tok + len, UINT64_MAX, &v) != 0 || p != tok + len || v == 0)
        return parse_fail(ps, "the epoch must be a decimal number from 1 to %" PRIu64, UINT64_MAX);
    ps->epoch = v;
    ps->epoch_line = ps->line;
    return 0;
}

/* The ranges "FIRST-LAST[,FIRST-LAST...]" of shard ps->n (its line), into ps->owner. */
static int parse_ranges(map_parse *ps, const char *tok, size_t len)
{
    const char *p = tok, *end = tok + len;
    for (;;) {
        uint64_t first = 0, last = 0;
        if (parse_dec(&p, end, TS_SLOTS - 1, &first) != 0 || p == end || *p != '-')
            return parse_fail(ps, "a range must be FIRST-LAST with slots from 0 to %u",
                              TS_SLOTS - 1);
        p++;
        if (parse_dec(&p, end, TS_SLOTS - 1, &last) != 0 || (p != end && *p != ','))
            return parse_fail(ps, "a range must be FIRST-LAST with slots from 0 to %u",
                              TS_SLOTS - 1);
        if (first > last)
            return parse_fail(ps, "range %" PRIu64 "-%" PRIu64 " ends before it starts", first,
                              last);
        for (uint64_t s = first; s <= last; s++) {
            if (ps->owner[s] != TS_SHARD_NONE)
                return parse_fail(ps, "slot %" PRIu64 " is already owned by line %" PRIu32, s,
                                  ps->shard_line[ps->owner[s]]);
            ps->owner[s] = (uint16_t)ps->n;
        }
        if (p == end)
            return 0;
        p++; /* the comma; a range must follow it */
    }
}

int ts__shard_addr_ok(const char *a, size_t len)
{
    if (len == 0 || len > TS_SHARD_ADDR_MAX)
        return 0;
    for (size_t i = 0; i < len; i++)
        if (a[i] <= 0x20 || a[i] >= 0x7F || a[i] == ',')
            return 0;
    return 1;
}

/* One line of text (comment and line end not yet removed). */
static int parse_line(map_parse *ps, const char *p, const char *end)
{
    const char *hash = memchr(p, '#', (size_t)(end - p));
    if (hash != NULL)
        end = hash;
    if (memchr(p, '\0', (size_t)(end - p)) != NULL)
        return parse_fail(ps, "a NUL byte");
    const char *tok[3];
    size_t len[3];
    int n = 0;
    while (n < 3 && next_token(&p, end, &tok[n], &len[n]))
        n++;
    if (n == 0)
        return 0;
    if (n == 3)
        return parse_fail(ps, "expected ADDRESS [FIRST-LAST[,FIRST-LAST...]], found more");
    if (len[0] == 5 && memcmp(tok[0], "epoch", 5) == 0) {
        if (n != 2)
            return parse_fail(ps, "expected 'epoch N'");
        return parse_epoch(ps, tok[1], len[1]);
    }
    if (ps->n == TS_SHARD_MAX)
        return parse_fail(ps, "more than %u shards", TS_SHARD_MAX);
    if (len[0] > TS_SHARD_ADDR_MAX)
        return parse_fail(ps, "the address is longer than %u bytes", TS_SHARD_ADDR_MAX);
    if (!ts__shard_addr_ok(tok[0], len[0]))
        return parse_fail(ps, "the address has a control, non-ASCII or ',' character");
    /* "tcp://A" and "A" are one address. */
    const char *a = tok[0];
    size_t al = len[0];
    if (al > 6 && memcmp(a, "tcp://", 6) == 0) {
        a += 6;
        al -= 6;
    }
    for (uint32_t i = 0; i < ps->n; i++) {
        const char *b = ps->addr[i];
        size_t bl = ps->addr_len[i];
        if (bl > 6 && memcmp(b, "tcp://", 6) == 0) {
            b += 6;
            bl -= 6;
        }
        if (bl == al && memcmp(a, b, al) == 0)
            return parse_fail(ps, "address %.*s is also on line %" PRIu32, (int)len[0], tok[0],
                              ps->shard_line[i]);
    }
    int ranged = n == 2;
    if (ps->ranged >= 0 && ps->ranged != ranged)
        return parse_fail(ps,
                          "either every shard line has ranges or none has (line %" PRIu32 " %s)",
                          ps->shard_line[0], ps->ranged ? "has" : "has not");
    ps->ranged = ranged;
    ps->shard_line[ps->n] = ps->line;
    if (ranged) {
        int rc = parse_ranges(ps, tok[1], len[1]);
        if (rc != 0)
            return rc;
    }
    ps->addr[ps->n] = tok[0];
    ps->addr_len[ps->n] = len[0];
    ps->n++;
    return 0;
}

/* After the last line: the shard count, the coverage, then the map itself. */
static int parse_finish(map_parse *ps, ts__shard_map **out)
{
    if (ps->line == 0)
        ps->line = 1; /* an empty file: its one (empty) line */
    if (ps->n == 0)
        return parse_fail(ps, "end of file: no shard lines");
    if (ps->ranged) {
        for (uint32_t s = 0; s < TS_SLOTS; s++) {
            if (ps->owner[s] != TS_SHARD_NONE)
                continue;
            uint32_t e = s;
            while (e + 1 < TS_SLOTS && ps->owner[e + 1] == TS_SHARD_NONE)
                e++;
            return parse_fail(ps, "end of file: slots %" PRIu32 "-%" PRIu32 " belong to no shard",
                              s, e);
        }
    } else {
        split_default(ps->owner, ps->n);
    }
    ts__shard_map *m = map_new(ps->n, ps->epoch != 0 ? ps->epoch : 1);
    if (m == NULL)
        return TS_ENOMEM;
    memcpy(m->owner, ps->owner, sizeof(m->owner));
    int rc = map_ranges(m); /* cannot be TS_EINVAL: every slot is owned and every line ranged */
    for (uint32_t i = 0; rc == 0 && i < ps->n; i++)
        rc = map_set_addr(m, i, ps->addr[i], ps->addr_len[i]);
    if (rc != 0) {
        ts__shard_map_free(m);
        return rc;
    }
    *out = m;
    return 0;
}

int ts__shard_map_parse(const char *text, size_t len, ts__shard_map **out, char *err,
                        size_t err_cap)
{
    map_parse *ps = ts__calloc(1, sizeof(*ps));
    uint16_t *owner = ts__malloc(TS_SLOTS * sizeof(*owner));
    uint32_t *shard_line = ts__calloc(TS_SHARD_MAX, sizeof(*shard_line));
    int rc = 0;
    if (ps == NULL || owner == NULL || shard_line == NULL) {
        rc = TS_ENOMEM;
        goto done;
    }
    if (err != NULL && err_cap > 0)
        err[0] = '\0';
    ps->err = err;
    ps->err_cap = err_cap;
    ps->ranged = -1;
    ps->owner = owner;
    ps->shard_line = shard_line;
    for (uint32_t s = 0; s < TS_SLOTS; s++)
        owner[s] = TS_SHARD_NONE;
    const char *p = text, *end = text + len;
    while (rc == 0 && p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *line_end = nl != NULL ? nl : end;
        ps->line++;
        rc = parse_line(ps, p, line_end);
        p = nl != NULL ? nl + 1 : end;
    }
    if (rc == 0)
        rc = parse_finish(ps, out);
done:
    ts__free(shard_line);
    ts__free(owner);
    ts__free(ps);
    return rc;
}

/* Write "<fmt>" into err and return TS_EINVAL. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int
load_fail(char *err, size_t err_cap, const char *fmt, ...)
{
    if (err != NULL && err_cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        (void)vsnprintf(err, err_cap, fmt, ap);
        va_end(ap);
    }
    return TS_EINVAL;
}

int ts__shard_map_load(const char *path, ts__shard_map **out, char *err, size_t err_cap)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return load_fail(err, err_cap, "%s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        (void)close(fd);
        return load_fail(err, err_cap, "%s: not a regular file", path);
    }
    if ((uint64_t)st.st_size > TS_SHARD_MAP_FILE_MAX) {
        (void)close(fd);
        return load_fail(err, err_cap, "%s: larger than %zu bytes", path, TS_SHARD_MAP_FILE_MAX);
    }
    /* Read to the end (at most the limit plus one byte), in case the file grew since fstat. */
    size_t cap = (size_t)st.st_size + 1, len = 0;
    char *buf = ts__malloc(cap);
    if (buf == NULL) {
        (void)close(fd);
        return TS_ENOMEM;
    }
    for (;;) {
        if (len == cap) {
            if (cap > TS_SHARD_MAP_FILE_MAX)
                break;
            size_t ncap = cap * 2 > TS_SHARD_MAP_FILE_MAX + 1 ? TS_SHARD_MAP_FILE_MAX + 1 : cap * 2;
            char *nb = ts__realloc(buf, ncap);
            if (nb == NULL) {
                ts__free(buf);
                (void)close(fd);
                return TS_ENOMEM;
            }
            buf = nb;
            cap = ncap;
        }
        ssize_t k = read(fd, buf + len, cap - len);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0) {
            int e = errno;
            ts__free(buf);
            (void)close(fd);
            return load_fail(err, err_cap, "%s: %s", path, strerror(e));
        }
        if (k == 0)
            break;
        len += (size_t)k;
    }
    (void)close(fd);
    int rc;
    if (len > TS_SHARD_MAP_FILE_MAX) {
        rc = load_fail(err, err_cap, "%s: larger than %zu bytes", path, TS_SHARD_MAP_FILE_MAX);
    } else {
        char msg[TS_SHARD_MAP_ERR_MAX];
        rc = ts__shard_map_parse(buf, len, out, msg, sizeof(msg));
        if (rc == TS_EINVAL)
            (void)load_fail(err, err_cap, "%s: %s", path, msg);
    }
    ts__free(buf);
    return rc;
}
