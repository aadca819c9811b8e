/*
 * The sharding bodies (msg_shard.h): SHARD_MAP's reply and WRONG_SHARD's body. Written field by
 * field, read through the bounded reader; the SHARD_MAP decoder also checks that the ranges
 * cover every slot exactly once, so a client never adopts a map with holes or overlaps.
 */
#include "msg.h"

#include <assert.h>

_Static_assert(TS_MSG_SHARD_MAP_FIXED == 8 + 2 + 2 + 4, "SHARD_MAP reply head layout");
_Static_assert(TS_MSG_WRONG_SHARD_FIXED == 2 + 2 + 2 + 2 + 8, "WRONG_SHARD body layout");
_Static_assert(TS_MSG_WRONG_SHARD_FIXED + TS_SHARD_ADDR_MAX < TS_MAX_ERRMSG,
               "a WRONG_SHARD body with the longest address leaves room for a message");
_Static_assert(TS_SHARD_MAX <= UINT16_MAX && TS_SLOTS <= UINT16_MAX,
               "n_shards and n_ranges are u16 on the wire");

size_t ts__msg_shard_map_size(const ts__shard_map *map)
{
    if (map == NULL)
        return TS_MSG_SHARD_MAP_FIXED;
    size_t size = TS_MSG_SHARD_MAP_FIXED + (size_t)map->n_ranges * TS_MSG_SHARD_RANGE;
    for (uint32_t i = 0; i < map->n_shards; i++)
        size += TS_MSG_SHARD_ENTRY_FIXED + strlen(map->addrs[i]);
    return size;
}

int ts__msg_shard_map_encode(uint8_t *out, size_t cap, const ts__shard_map *map, uint16_t self,
                             size_t *len)
{
    if (map != NULL && (self >= map->n_shards || map->n_shards > TS_SHARD_MAX))
        return TS_EINVAL;
    size_t need = ts__msg_shard_map_size(map);
    if (need > cap)
        return TS_EMSGSIZE;
    if (map == NULL) {
        ts__put_u64le(out, 0);
        ts__put_u16le(out + 8, 0);
        ts__put_u16le(out + 10, TS_SHARD_NONE);
        ts__put_u32le(out + 12, 0);
        *len = need;
        return 0;
    }
    ts__put_u64le(out, map->epoch);
    ts__put_u16le(out + 8, (uint16_t)map->n_shards);
    ts__put_u16le(out + 10, self);
    ts__put_u32le(out + 12, 0);
    size_t off = TS_MSG_SHARD_MAP_FIXED;
    for (uint32_t i = 0; i < map->n_shards; i++) {
        size_t alen = strlen(map->addrs[i]);
        uint32_t r0 = map->range_off[i], r1 = map->range_off[i + 1];
        assert(alen <= TS_SHARD_ADDR_MAX && r1 - r0 <= TS_SLOTS);
        ts__put_u16le(out + off, (uint16_t)alen);
        ts__put_u16le(out + off + 2, (uint16_t)(r1 - r0));
        off += TS_MSG_SHARD_ENTRY_FIXED;
        if (alen > 0)
            memcpy(out + off, map->addrs[i], alen);
        off += alen;
        for (uint32_t r = r0; r < r1; r++) {
            ts__put_u16le(out + off, map->ranges[r].first);
            ts__put_u16le(out + off + 2, map->ranges[r].last);
            off += TS_MSG_SHARD_RANGE;
        }
    }
    assert(off == need);
    *len = need;
    return 0;
}

int ts__msg_shard_map_decode(const uint8_t *body, size_t len, ts__msg_shard_map *m)
{
    ts__rd r;
    uint64_t epoch = 0;
    uint16_t n = 0, self = 0;
    uint32_t reserved = 0;
    ts__rd_init(&r, body, len);
    ts__rd_u64(&r, &epoch);
    ts__rd_u16(&r, &n);
    ts__rd_u16(&r, &self);
    ts__rd_u32(&r, &reserved);
    if (r.err != 0 || reserved != 0 || n > TS_SHARD_MAX)
        return TS_EPROTO;
    if (n == 0) {
        if (epoch != 0 || self != TS_SHARD_NONE || r.left != 0)
            return TS_EPROTO;
    } else if (self >= n) {
        return TS_EPROTO;
    }
    const uint8_t *entries = r.p;
    size_t entries_len = r.left;
    /* One bit per slot: the ranges must cover each exactly once. */
    uint8_t seen[TS_SLOTS / 8];
    memset(seen, 0, sizeof(seen));
    uint32_t covered = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint16_t alen = 0, nr = 0;
        ts__rd_u16(&r, &alen);
        ts__rd_u16(&r, &nr);
        if (r.err != 0 || nr == 0 || nr > TS_SLOTS || alen > TS_SHARD_ADDR_MAX)
            return TS_EPROTO;
        const uint8_t *addr = ts__rd_bytes(&r, alen);
        if (addr == NULL || (alen > 0 && !ts__shard_addr_ok((const char *)addr, alen)))
            return TS_EPROTO;
        const uint8_t *ranges = ts__rd_bytes(&r, (size_t)nr * TS_MSG_SHARD_RANGE);
        if (ranges == NULL)
            return TS_EPROTO;
        for (uint16_t k = 0; k < nr; k++) {
            ts__slot_range rg = ts__msg_shard_range(ranges, k);
            if (rg.first > rg.last || rg.last >= TS_SLOTS)
                return TS_EPROTO;
            for (uint32_t s = rg.first; s <= rg.last; s++) {
                if (seen[s / 8] & (1u << (s % 8)))
                    return TS_EPROTO;
                seen[s / 8] |= (uint8_t)(1u << (s % 8));
            }
            covered += (uint32_t)(rg.last - rg.first) + 1;
        }
    }
    if (r.left != 0 || (n > 0 && covered != TS_SLOTS))
        return TS_EPROTO;
    m->epoch = epoch;
    m->n_shards = n;
    m->self = self;
    m->entries = entries;
    m->entries_len = entries_len;
    return 0;
}

ts__slot_range ts__msg_shard_range(const uint8_t *ranges, uint16_t i)
{
    ts__slot_range rg;
    rg.first = ts__get_u16le(ranges + (size_t)i * TS_MSG_SHARD_RANGE);
    rg.last = ts__get_u16le(ranges + (size_t)i * TS_MSG_SHARD_RANGE + 2);
    return rg;
}

int ts__msg_shard_map_next(const ts__msg_shard_map *m, size_t *off, const uint8_t **addr,
                           size_t *addr_len, const uint8_t **ranges, uint16_t *n_ranges)
{
    /* The decoder checked every entry, so these reads stay inside the body. */
    if (*off >= m->entries_len)
        return 0;
    const uint8_t *p = m->entries + *off;
    uint16_t alen = ts__get_u16le(p), nr = ts__get_u16le(p + 2);
    *addr = p + TS_MSG_SHARD_ENTRY_FIXED;
    *addr_len = alen;
    *ranges = p + TS_MSG_SHARD_ENTRY_FIXED + alen;
    *n_ranges = nr;
    *off += TS_MSG_SHARD_ENTRY_FIXED + alen + (size_t)nr * TS_MSG_SHARD_RANGE;
    return 1;
}

int ts__msg_shard_map_encode_again(const ts__msg_shard_map *m, uint8_t *out, size_t cap,
                                   size_t *len)
{
    size_t need = TS_MSG_SHARD_MAP_FIXED + m->entries_len;
    if (need > cap)
        return TS_EMSGSIZE;
    ts__put_u64le(out, m->epoch);
    ts__put_u16le(out + 8, m->n_shards);
    ts__put_u16le(out + 10, m->self);
    ts__put_u32le(out + 12, 0);
    size_t off = 0, w = TS_MSG_SHARD_MAP_FIXED;
    const uint8_t *addr, *ranges;
    size_t alen;
    uint16_t nr;
    while (ts__msg_shard_map_next(m, &off, &addr, &alen, &ranges, &nr)) {
        ts__put_u16le(out + w, (uint16_t)alen);
        ts__put_u16le(out + w + 2, nr);
        w += TS_MSG_SHARD_ENTRY_FIXED;
        if (alen > 0)
            memcpy(out + w, addr, alen);
        w += alen;
        for (uint16_t k = 0; k < nr; k++) {
            ts__slot_range rg = ts__msg_shard_range(ranges, k);
            ts__put_u16le(out + w, rg.first);
            ts__put_u16le(out + w + 2, rg.last);
            w += TS_MSG_SHARD_RANGE;
        }
    }
    assert(w == need);
    *len = need;
    return 0;
}

int ts__shard_map_from_msg(const ts__msg_shard_map *m, ts__shard_map **out)
{
    if (m->n_shards == 0)
        return TS_EINVAL;
    uint16_t *owner = ts__malloc(TS_SLOTS * sizeof(*owner));
    char **addrs = ts__calloc(m->n_shards, sizeof(*addrs));
    int rc = 0;
    if (owner == NULL || addrs == NULL) {
        rc = TS_ENOMEM;
        goto done;
    }
    size_t off = 0;
    const uint8_t *addr, *ranges;
    size_t alen;
    uint16_t nr;
    for (uint16_t i = 0; rc == 0 && ts__msg_shard_map_next(m, &off, &addr, &alen, &ranges, &nr);
         i++) {
        addrs[i] = ts__strndup((const char *)addr, alen);
        if (addrs[i] == NULL)
            rc = TS_ENOMEM;
        for (uint16_t k = 0; k < nr; k++) {
            ts__slot_range rg = ts__msg_shard_range(ranges, k);
            for (uint32_t s = rg.first; s <= rg.last; s++)
                owner[s] = i;
        }
    }
    if (rc == 0)
        rc = ts__shard_map_from_owners(m->n_shards, owner, (const char *const *)addrs, m->epoch,
                                       out);
done:
    if (addrs != NULL)
        for (uint16_t i = 0; i < m->n_shards; i++)
            ts__free(addrs[i]);
    ts__free(addrs);
    ts__free(owner);
    return rc;
}

int ts__msg_wrong_shard_encode(uint8_t *out, size_t cap, const ts__msg_wrong_shard *m, size_t *len)
{
    if (m->slot >= TS_SLOTS || m->epoch == 0 || m->addr_len > TS_SHARD_ADDR_MAX ||
        (m->owner == TS_SHARD_NONE && m->addr_len > 0) ||
        m->msg_len > TS_MAX_ERRMSG - TS_MSG_WRONG_SHARD_FIXED - m->addr_len)
        return TS_EINVAL;
    size_t need = TS_MSG_WRONG_SHARD_FIXED + m->addr_len + m->msg_len;
    if (need > cap)
        return TS_EMSGSIZE;
    ts__put_u16le(out, m->slot);
    ts__put_u16le(out + 2, m->owner);
    ts__put_u16le(out + 4, (uint16_t)m->addr_len);
    ts__put_u16le(out + 6, 0);
    ts__put_u64le(out + 8, m->epoch);
    if (m->addr_len > 0)
        memcpy(out + TS_MSG_WRONG_SHARD_FIXED, m->addr, m->addr_len);
    if (m->msg_len > 0)
        memcpy(out + TS_MSG_WRONG_SHARD_FIXED + m->addr_len, m->msg, m->msg_len);
    *len = need;
    return 0;
}

int ts__msg_wrong_shard_decode(const uint8_t *body, size_t len, ts__msg_wrong_shard *m)
{
    if (len < TS_MSG_WRONG_SHARD_FIXED || len > TS_MAX_ERRMSG)
        return TS_EPROTO;
    uint16_t slot = ts__get_u16le(body), owner = ts__get_u16le(body + 2);
    uint16_t alen = ts__get_u16le(body + 4), reserved = ts__get_u16le(body + 6);
    uint64_t epoch = ts__get_u64le(body + 8);
    if (slot >= TS_SLOTS || reserved != 0 || epoch == 0 || alen > TS_SHARD_ADDR_MAX ||
        alen > len - TS_MSG_WRONG_SHARD_FIXED || (owner == TS_SHARD_NONE && alen > 0) ||
        (owner != TS_SHARD_NONE && owner >= TS_SHARD_MAX))
        return TS_EPROTO;
    const uint8_t *addr = body + TS_MSG_WRONG_SHARD_FIXED;
    if (alen > 0 && !ts__shard_addr_ok((const char *)addr, alen))
        return TS_EPROTO;
    m->slot = slot;
    m->owner = owner;
    m->epoch = epoch;
    m->addr = addr;
    m->addr_len = alen;
    m->msg = (const char *)addr + alen;
    m->msg_len = len - TS_MSG_WRONG_SHARD_FIXED - alen;
    return 0;
}
