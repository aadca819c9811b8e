/*
 * Fuzz target: the sharding decoders (src/msg_shard.c) and the map file parser (src/slot.c).
 * The first input byte picks one; the rest is its input.
 *   0  a SHARD_MAP reply body: a body that decodes must encode back to the same bytes, give the
 *      same result through the opcode table, walk inside the body, and, when sharded, build a
 *      map whose own encoding decodes to the same map.
 *   1  a WRONG_SHARD body: the same round trip, its pointers inside the body.
 *   2  a map file's text: a map it accepts must be complete (every slot owned by a shard below
 *      n_shards, ranges that match the owner table) and survive a SHARD_MAP round trip; a refusal
 *      must leave a message that names a line.
 * Every input also goes through ts__slot, which must give a slot below TS_SLOTS.
 */
#include "fuzz.h"

#include <stdlib.h>

#include "msg.h"
#include "slot.h"

static volatile uint8_t sink;

/* A map that is whole: owners below n, ranges that say the same as the owner table. */
static void check_map(const ts__shard_map *m)
{
    FZ_CHECK(m->n_shards >= 1 && m->n_shards <= TS_SHARD_MAX);
    for (uint32_t s = 0; s < TS_SLOTS; s++)
        FZ_CHECK(m->owner[s] < m->n_shards);
    uint32_t covered = 0;
    for (uint32_t i = 0; i < m->n_shards; i++) {
        FZ_CHECK(strlen(m->addrs[i]) <= TS_SHARD_ADDR_MAX);
        FZ_CHECK(m->range_off[i + 1] > m->range_off[i]);
        for (uint32_t r = m->range_off[i]; r < m->range_off[i + 1]; r++) {
            FZ_CHECK(m->ranges[r].first <= m->ranges[r].last);
            FZ_CHECK(m->owner[m->ranges[r].first] == i && m->owner[m->ranges[r].last] == i);
            covered += (uint32_t)(m->ranges[r].last - m->ranges[r].first) + 1;
        }
    }
    FZ_CHECK(covered == TS_SLOTS);
}

/* Encode m as a SHARD_MAP reply, decode it, build it again: the same map. */
static void map_round_trip(const ts__shard_map *m)
{
    size_t size = ts__msg_shard_map_size(m), len = 0;
    uint8_t *buf = malloc(size);
    FZ_CHECK(buf != NULL);
    FZ_CHECK(ts__msg_shard_map_encode(buf, size, m, 0, &len) == 0 && len == size);
    ts__msg_shard_map d;
    FZ_CHECK(ts__msg_shard_map_decode(buf, len, &d) == 0);
    ts__shard_map *back = NULL;
    int rc = ts__shard_map_from_msg(&d, &back);
    FZ_CHECK(rc == 0 || rc == TS_ENOMEM);
    if (rc == 0) {
        FZ_CHECK(ts__shard_map_same(m, back) && back->epoch == m->epoch);
        ts__shard_map_free(back);
    }
    free(buf);
}

static void shard_map_input(const uint8_t *body, size_t len)
{
    ts__msg_shard_map d;
    if (ts__msg_shard_map_decode(body, len, &d) != 0)
        return;
    ts__msg m;
    FZ_CHECK(ts__msg_reply_decode(TS_OP_SHARD_MAP, TS_ST_OK, body, len, &m) == 0);
    FZ_CHECK(m.kind == TS_MSG_SHARD_MAP && m.u.shard_map.entries_len == d.entries_len);
    FZ_CHECK(len <= TS_MSG_SHARD_MAP_MAX);
    uint8_t *again = malloc(len);
    size_t n = 0;
    FZ_CHECK(again != NULL);
    FZ_CHECK(ts__msg_encode(&m, again, len, &n) == 0 && n == len);
    FZ_CHECK(memcmp(again, body, len) == 0);
    free(again);
    size_t off = 0;
    const uint8_t *addr, *ranges;
    size_t alen;
    uint16_t nr;
    uint32_t entries = 0;
    while (ts__msg_shard_map_next(&d, &off, &addr, &alen, &ranges, &nr)) {
        FZ_CHECK(addr >= body && addr + alen <= body + len);
        FZ_CHECK(ranges >= body && ranges + (size_t)nr * TS_MSG_SHARD_RANGE <= body + len);
        entries++;
    }
    FZ_CHECK(entries == d.n_shards);
    if (d.n_shards == 0)
        return;
    ts__shard_map *map = NULL;
    int rc = ts__shard_map_from_msg(&d, &map);
    FZ_CHECK(rc == 0 || rc == TS_ENOMEM);
    if (rc != 0)
        return;
    check_map(map);
    map_round_trip(map);
    ts__shard_map_free(map);
}

static void wrong_shard_input(const uint8_t *body, size_t len)
{
    ts__msg_wrong_shard w;
    if (ts__msg_wrong_shard_decode(body, len, &w) != 0)
        return;
    FZ_CHECK(w.slot < TS_SLOTS && w.epoch != 0 && w.addr_len <= TS_SHARD_ADDR_MAX);
    FZ_CHECK(w.addr == body + TS_MSG_WRONG_SHARD_FIXED);
    FZ_CHECK((const uint8_t *)w.msg + w.msg_len == body + len);
    if (w.msg_len > 0)
        sink = (uint8_t)w.msg[w.msg_len - 1];
    ts__msg m;
    FZ_CHECK(ts__msg_reply_decode(TS_OP_GET, TS_ST_WRONG_SHARD, body, len, &m) == 0);
    FZ_CHECK(m.kind == TS_MSG_WRONG_SHARD);
    uint8_t again[TS_MAX_ERRMSG];
    size_t n = 0;
    FZ_CHECK(ts__msg_encode(&m, again, sizeof(again), &n) == 0 && n == len);
    FZ_CHECK(memcmp(again, body, len) == 0);
}

static void map_file_input(const uint8_t *text, size_t len)
{
    char err[TS_SHARD_MAP_ERR_MAX];
    ts__shard_map *m = NULL;
    int rc = ts__shard_map_parse((const char *)text, len, &m, err, sizeof(err));
    if (rc == TS_EINVAL) {
        FZ_CHECK(strncmp(err, "line ", 5) == 0);
        return;
    }
    FZ_CHECK(rc == 0 || rc == TS_ENOMEM);
    if (rc != 0)
        return;
    FZ_CHECK(m->epoch >= 1);
    check_map(m);
    map_round_trip(m);
    ts__shard_map_free(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    FZ_CHECK(ts__slot(data, size) < TS_SLOTS);
    const uint8_t *body = data + 1;
    size_t len = size - 1;
    switch (data[0] % 3) {
    case 0:
        shard_map_input(body, len);
        break;
    case 1:
        wrong_shard_input(body, len);
        break;
    default:
        map_file_input(body, len);
        break;
    }
    return 0;
}
