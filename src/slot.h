/*
 * Slots and shard maps (docs/PROTOCOL.md section 14): the one implementation of a name's slot,
 * of the default split, and of the map file, used by tensord (--shard, --cluster-map), the
 * cluster client and the parameter server.
 *
 * A name's slot is CRC-16/XMODEM of its key modulo TS_SLOTS; the key is the bytes between the
 * first '{' and the first '}' after it when those are not empty, else the whole name (so that
 * "{run7}.params" and "{run7}.grads" land on one shard). A shard map gives each of its n shards
 * a set of slot ranges that together cover every slot exactly once, an address per shard (or
 * none when unknown) and an epoch that orders maps (a higher epoch replaces a lower one).
 *
 * Thread: a map is immutable once built; any number of threads may read one. Building and
 * freeing are the caller's to order. The functions keep no state.
 *
 * Added in 0.5.0.
 */
#ifndef TS_SLOT_H
#define TS_SLOT_H

#include <stddef.h>
#include <stdint.h>

/* Slots of the keyspace: a slot is a u16 on the wire, and 2^14 leaves room for fine ranges. */
#define TS_SLOTS 16384u
/* Shards per map: a SHARD_MAP reply and the per-slot scan stay small (u16 on the wire). */
#define TS_SHARD_MAX 1024u
/* Bytes of a shard's address (u16 addr_len on the wire; a host:port is far shorter). */
#define TS_SHARD_ADDR_MAX 255u
/* The owner of a slot a map cannot name (a WRONG_SHARD body's owner field, SHARD_MAP's self). */
#define TS_SHARD_NONE 0xFFFFu
/*
 * Bytes of a map file: 1024 lines of a 255-byte address and 16384 ranges of at most 12 bytes
 * ("16383-16383,") take about 460 KiB, so 1 MiB holds any valid map while a wrong path (a
 * device, a huge log) is refused before it is read whole.
 */
#define TS_SHARD_MAP_FILE_MAX ((size_t)1 << 20)
/* Bytes of a map parser's error message, "line N: ..." included. */
#define TS_SHARD_MAP_ERR_MAX 256u

/* Slots [first, last], both inclusive. */
typedef struct ts__slot_range {
    uint16_t first;
    uint16_t last;
} ts__slot_range;

/*
 * A shard map. owner[] is the truth; ranges are derived from it (sorted and merged, so two maps
 * that own the same slots have the same ranges): shard i's ranges are
 * ranges[range_off[i]] to ranges[range_off[i + 1] - 1]. Build with the functions below, free with
 * ts__shard_map_free. Read the fields directly; do not change them.
 */
typedef struct ts__shard_map {
    uint64_t epoch;      /* 0 for a map from an address list, else at least 1 */
    uint32_t n_shards;   /* 1 to TS_SHARD_MAX */
    char **addrs;        /* n_shards NUL-terminated addresses; an entry is "" when unknown */
    uint32_t *range_off; /* n_shards + 1 offsets into ranges */
    ts__slot_range *ranges;
    uint32_t n_ranges;
    uint16_t owner[TS_SLOTS]; /* slot -> shard index */
} ts__shard_map;

/* CRC-16/XMODEM (poly 0x1021, init 0, no reflection, no final xor) of len bytes. */
uint16_t ts__crc16_xmodem(const void *p, size_t len);

/* The slot of a name of len bytes (len 0 gives the slot of the empty key, 0). */
uint16_t ts__slot(const void *name, size_t len);

/*
 * The first slot of shard i of n under the default split: floor(i * TS_SLOTS / n). Shard i owns
 * [ts__slot_split_first(i, n), ts__slot_split_first(i + 1, n) - 1] (slot TS_SLOTS for i = n). n
 * in 1..TS_SHARD_MAX, i in 0..n.
 */
uint32_t ts__slot_split_first(uint32_t i, uint32_t n);

/*
 * A map of n shards (1..TS_SHARD_MAX) with the default split. addrs is NULL (every address
 * unknown) or n NUL-terminated addresses (borrowed, copied; each at most TS_SHARD_ADDR_MAX bytes).
 * 0 and *out (the caller's, free with ts__shard_map_free); TS_EINVAL for n or an address out of
 * range; TS_ENOMEM.
 */
int ts__shard_map_default(uint32_t n, const char *const *addrs, uint64_t epoch,
                          ts__shard_map **out);

/*
 * A map from a slot -> shard table of TS_SLOTS entries (each below n) and n addresses (NULL: all
 * unknown; an entry may be "" for unknown). Builds the ranges. 0 and *out; TS_EINVAL for an owner
 * at or over n, an n out of range, a shard owning no slot, or an address too long; TS_ENOMEM.
 */
int ts__shard_map_from_owners(uint32_t n, const uint16_t *owner, const char *const *addrs,
                              uint64_t epoch, ts__shard_map **out);

/*
 * Parse a map file's text of len bytes (docs/PROTOCOL.md 14.2): comments from '#', blank lines,
 * at most one "epoch N" line (N >= 1; default 1), and one "ADDRESS [FIRST-LAST[,...]]" line per
 * shard in index order; either no line has ranges (the default split) or every line has and they
 * cover every slot exactly once. 0 and *out; TS_EINVAL with a message naming the line in
 * err[err_cap] (when err is not NULL) for text that breaks the format; TS_ENOMEM.
 */
int ts__shard_map_parse(const char *text, size_t len, ts__shard_map **out, char *err,
                        size_t err_cap);

/*
 * Read and parse the map file at path (at most TS_SHARD_MAP_FILE_MAX bytes). As
 * ts__shard_map_parse, plus TS_EINVAL with a message for a file that cannot be read or is too
 * large. Blocking file I/O: not for an event loop thread once it serves.
 */
int ts__shard_map_load(const char *path, ts__shard_map **out, char *err, size_t err_cap);

/*
 * 1 when len bytes are a valid address in a map: 1 to TS_SHARD_ADDR_MAX bytes of printable ASCII
 * other than space and ','. (Whether it names a reachable host is the client's to find out.)
 */
int ts__shard_addr_ok(const char *addr, size_t len);

/* Free a map; NULL is a no-op. */
void ts__shard_map_free(ts__shard_map *m);

/* The shard that owns slot (below TS_SLOTS). */
static inline uint16_t ts__shard_map_owner(const ts__shard_map *m, uint16_t slot)
{
    return m->owner[slot & (TS_SLOTS - 1)];
}

/* 1 when a and b give every slot the same owner and every shard the same address. */
int ts__shard_map_same(const ts__shard_map *a, const ts__shard_map *b);

#endif /* TS_SLOT_H */
