/*
 * Sharding bodies (msg_shard.c): the SHARD_MAP reply (opcode 0x30, docs/PROTOCOL.md 8.44) and
 * the WRONG_SHARD error body (status 11, section 14.4). Included by msg.h; the conventions of
 * msg.h hold (strict decoders, encoders that check their room first), except that
 * ts__shard_map_from_msg builds a heap map from a decoded reply.
 *
 *   SHARD_MAP reply: u64 map_epoch, u16 n_shards, u16 self, u32 reserved 0, then n_shards
 *                    entries: u16 addr_len, u16 n_ranges, addr bytes, n_ranges x (u16 first,
 *                    u16 last). n_shards 0 (with epoch 0 and self 0xFFFF): not sharded.
 *   WRONG_SHARD:     u16 slot, u16 owner, u16 addr_len, u16 reserved 0, u64 map_epoch,
 *                    addr bytes, then a message to the end (the whole body at most
 *                    TS_MAX_ERRMSG bytes, so that a client that reads it as an error message
 *                    still takes it).
 *
 * Added in 0.5.0.
 */
#ifndef TS_MSG_SHARD_H
#define TS_MSG_SHARD_H

#include "slot.h"

#define TS_MSG_SHARD_MAP_FIXED   16 /* u64 epoch, u16 n_shards, u16 self, u32 reserved */
#define TS_MSG_SHARD_ENTRY_FIXED 4  /* u16 addr_len, u16 n_ranges */
#define TS_MSG_SHARD_RANGE       4  /* u16 first, u16 last */
/*
 * bytes; the largest SHARD_MAP reply: TS_SHARD_MAX entries with the longest address, and at
 * most TS_SLOTS ranges in all (each owns a slot of its own). About 324 KiB.
 */
#define TS_MSG_SHARD_MAP_MAX                                                                       \
    ((uint64_t)TS_MSG_SHARD_MAP_FIXED +                                                            \
     (uint64_t)TS_SHARD_MAX * (TS_MSG_SHARD_ENTRY_FIXED + TS_SHARD_ADDR_MAX) +                     \
     (uint64_t)TS_SLOTS * TS_MSG_SHARD_RANGE)
#define TS_MSG_WRONG_SHARD_FIXED 16 /* slot, owner, addr_len, reserved, map_epoch */

/* A decoded SHARD_MAP reply; entries point into the body. */
typedef struct ts__msg_shard_map {
    uint64_t epoch;
    uint16_t n_shards; /* 0: not sharded */
    uint16_t self;     /* TS_SHARD_NONE when not sharded */
    const uint8_t *entries;
    size_t entries_len;
} ts__msg_shard_map;

/* The body size for map (NULL: a daemon that is not sharded). */
size_t ts__msg_shard_map_size(const ts__shard_map *map);
/*
 * Write the reply for map with self (below map->n_shards), or the not-sharded reply for map
 * NULL (self is ignored). TS_EINVAL for a self out of range; TS_EMSGSIZE.
 */
int ts__msg_shard_map_encode(uint8_t *out, size_t cap, const ts__shard_map *map, uint16_t self,
                             size_t *len);
/*
 * Strict decode: reserved 0; n_shards 0 exactly with epoch 0 and self 0xFFFF and nothing after;
 * else n_shards at most TS_SHARD_MAX, self below it, every entry's addr_len at most
 * TS_SHARD_ADDR_MAX of printable ASCII without ',' or ' ', 1 to TS_SLOTS ranges with first <=
 * last < TS_SLOTS, the ranges of all entries covering every slot exactly once, nothing after the
 * last entry.
 */
int ts__msg_shard_map_decode(const uint8_t *body, size_t len, ts__msg_shard_map *m);
/*
 * The next entry of a decoded reply (*off starts at 0): 1 with its address and its n_ranges
 * ranges (u16 pairs, read them with ts__msg_shard_range), or 0 after the last.
 */
int ts__msg_shard_map_next(const ts__msg_shard_map *m, size_t *off, const uint8_t **addr,
                           size_t *addr_len, const uint8_t **ranges, uint16_t *n_ranges);
/* Range i of an entry's ranges. */
ts__slot_range ts__msg_shard_range(const uint8_t *ranges, uint16_t i);
/* Encode a decoded reply again, field by field (fuzzers and tests compare the bytes). */
int ts__msg_shard_map_encode_again(const ts__msg_shard_map *m, uint8_t *out, size_t cap,
                                   size_t *len);
/*
 * The map of a decoded, sharded reply (n_shards >= 1): 0 and *out (the caller's; free with
 * ts__shard_map_free); TS_EINVAL for a not-sharded reply; TS_ENOMEM. Allocates.
 */
int ts__shard_map_from_msg(const ts__msg_shard_map *m, ts__shard_map **out);

/* A WRONG_SHARD body. */
typedef struct ts__msg_wrong_shard {
    uint16_t slot;       /* the slot of the name, below TS_SLOTS */
    uint16_t owner;      /* the owning shard, or TS_SHARD_NONE */
    uint64_t epoch;      /* the answering daemon's map epoch, at least 1 */
    const uint8_t *addr; /* the owner's address (addr_len 0: unknown); borrowed */
    size_t addr_len;
    const char *msg; /* human-readable; borrowed, not NUL-terminated */
    size_t msg_len;
} ts__msg_wrong_shard;
/*
 * TS_EINVAL for a slot out of range, epoch 0, an owner of TS_SHARD_NONE with an address, an
 * address over TS_SHARD_ADDR_MAX bytes, or a body over TS_MAX_ERRMSG bytes (the message is the
 * caller's to shorten: at most TS_MAX_ERRMSG - 16 - addr_len bytes); TS_EMSGSIZE.
 */
int ts__msg_wrong_shard_encode(uint8_t *out, size_t cap, const ts__msg_wrong_shard *m, size_t *len);
/* Strict decode: the limits the encoder checks, the reserved field 0, the address in the body. */
int ts__msg_wrong_shard_decode(const uint8_t *body, size_t len, ts__msg_wrong_shard *m);

#endif /* TS_MSG_SHARD_H */
