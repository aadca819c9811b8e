/*
 * The sharding bodies of src/msg_shard.c (docs/PROTOCOL.md 8.44 and 14.4): SHARD_MAP replies
 * and WRONG_SHARD bodies encode, decode through the opcode table, encode again to the same
 * bytes and give the same map back; every shorter prefix, one byte more and each broken field
 * is refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdlib.h>

#include "msg.h"

/* Encode map with self, decode it through the table, and check the round trips. */
static void shard_map_round_trip(const ts__shard_map *map, uint16_t self)
{
    size_t size = ts__msg_shard_map_size(map), len = 0;
    assert_true(size <= TS_MSG_SHARD_MAP_MAX);
    uint8_t *buf = malloc(size + 1), *again = malloc(size + 1);
    assert_non_null(buf);
    assert_non_null(again);
    assert_int_equal(ts__msg_shard_map_encode(buf, size - 1, map, self, &len), TS_EMSGSIZE);
    assert_int_equal(ts__msg_shard_map_encode(buf, size, map, self, &len), 0);
    assert_int_equal(len, size);
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_SHARD_MAP, TS_ST_OK, buf, len, &m), 0);
    assert_int_equal(m.kind, TS_MSG_SHARD_MAP);
    size_t n = 0;
    assert_int_equal(ts__msg_encode(&m, again, size, &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(again, buf, len);
    if (map != NULL) {
        assert_int_equal(m.u.shard_map.epoch, map->epoch);
        assert_int_equal(m.u.shard_map.n_shards, map->n_shards);
        assert_int_equal(m.u.shard_map.self, self);
        ts__shard_map *back = NULL;
        assert_int_equal(ts__shard_map_from_msg(&m.u.shard_map, &back), 0);
        assert_true(ts__shard_map_same(back, map));
        assert_int_equal(back->epoch, map->epoch);
        ts__shard_map_free(back);
    } else {
        assert_int_equal(m.u.shard_map.n_shards, 0);
        assert_int_equal(m.u.shard_map.self, TS_SHARD_NONE);
        ts__shard_map *back = NULL;
        assert_int_equal(ts__shard_map_from_msg(&m.u.shard_map, &back), TS_EINVAL);
    }
    /* Every prefix and one trailing byte are refused. */
    ts__msg_shard_map d;
    for (size_t k = 0; k < len; k++)
        assert_int_equal(ts__msg_shard_map_decode(buf, k, &d), TS_EPROTO);
    buf[len] = 0;
    assert_int_equal(ts__msg_shard_map_decode(buf, len + 1, &d), TS_EPROTO);
    free(buf);
    free(again);
}

static void test_shard_map_round_trips(void **state)
{
    (void)state;
    shard_map_round_trip(NULL, 0);
    ts__shard_map *m = NULL;
    assert_int_equal(ts__shard_map_default(1, NULL, 1, &m), 0);
    shard_map_round_trip(m, 0);
    ts__shard_map_free(m);
    const char *addrs[] = {"h1:8000", "tls://h2:8000", "[::1]:9"};
    assert_int_equal(ts__shard_map_default(3, addrs, 5, &m), 0);
    shard_map_round_trip(m, 2);
    ts__shard_map_free(m);
    assert_int_equal(ts__shard_map_default(TS_SHARD_MAX, NULL, UINT64_MAX, &m), 0);
    shard_map_round_trip(m, TS_SHARD_MAX - 1);
    ts__shard_map_free(m);
    /* The most ranges a map can have: every slot its own range. */
    static uint16_t owner[TS_SLOTS];
    for (uint32_t s = 0; s < TS_SLOTS; s++)
        owner[s] = (uint16_t)(s % 3);
    assert_int_equal(ts__shard_map_from_owners(3, owner, addrs, 2, &m), 0);
    shard_map_round_trip(m, 1);
    /* self out of range */
    uint8_t small[64];
    size_t len;
    assert_int_equal(ts__msg_shard_map_encode(small, sizeof(small), m, 3, &len), TS_EINVAL);
    ts__shard_map_free(m);
}

/* The body of a two-shard map, by hand: shard 0 "a:1" 0-99, shard 1 (no address) 100-16383. */
static size_t two_shards(uint8_t *b)
{
    memset(b, 0, 64);
    ts__put_u64le(b, 3);
    ts__put_u16le(b + 8, 2);
    ts__put_u16le(b + 10, 1);
    ts__put_u16le(b + 16, 3);
    ts__put_u16le(b + 18, 1);
    memcpy(b + 20, "a:1", 3);
    ts__put_u16le(b + 23, 0);
    ts__put_u16le(b + 25, 99);
    ts__put_u16le(b + 27, 0);
    ts__put_u16le(b + 29, 1);
    ts__put_u16le(b + 31, 100);
    ts__put_u16le(b + 33, 16383);
    return 35;
}

static void test_shard_map_refused(void **state)
{
    (void)state;
    uint8_t b[64];
    ts__msg_shard_map d;
    size_t len = two_shards(b);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), 0);
    /* reserved */
    two_shards(b);
    b[12] = 1;
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    /* self at n_shards */
    two_shards(b);
    ts__put_u16le(b + 10, 2);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    /* n_shards over the limit, or more than the body holds */
    two_shards(b);
    ts__put_u16le(b + 8, TS_SHARD_MAX + 1);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    two_shards(b);
    ts__put_u16le(b + 8, 3);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    /* a hole (99 -> 98), an overlap (100 -> 99), a range past the last slot, first > last */
    two_shards(b);
    ts__put_u16le(b + 25, 98);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    two_shards(b);
    ts__put_u16le(b + 31, 99);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    two_shards(b);
    ts__put_u16le(b + 33, 16384);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    two_shards(b);
    ts__put_u16le(b + 31, 16383);
    ts__put_u16le(b + 33, 100);
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    /* a shard without ranges */
    two_shards(b);
    ts__put_u16le(b + 18, 0);
    assert_int_equal(ts__msg_shard_map_decode(b, len - 4, &d), TS_EPROTO);
    /* an address with a space or a comma */
    two_shards(b);
    b[21] = ' ';
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    two_shards(b);
    b[21] = ',';
    assert_int_equal(ts__msg_shard_map_decode(b, len, &d), TS_EPROTO);
    /* not sharded: epoch 0, n 0, self 0xFFFF, exactly 16 bytes */
    memset(b, 0, sizeof(b));
    ts__put_u16le(b + 10, TS_SHARD_NONE);
    assert_int_equal(ts__msg_shard_map_decode(b, 16, &d), 0);
    ts__put_u64le(b, 1);
    assert_int_equal(ts__msg_shard_map_decode(b, 16, &d), TS_EPROTO);
    ts__put_u64le(b, 0);
    ts__put_u16le(b + 10, 0);
    assert_int_equal(ts__msg_shard_map_decode(b, 16, &d), TS_EPROTO);
    /* an empty request body only */
    ts__msg m;
    assert_int_equal(ts__msg_request_decode(TS_OP_SHARD_MAP, b, 0, &m), 0);
    assert_int_equal(m.kind, TS_MSG_EMPTY);
    assert_int_equal(ts__msg_request_decode(TS_OP_SHARD_MAP, b, 1, &m), TS_EPROTO);
    assert_int_equal(ts__msg_reply_limit(TS_OP_SHARD_MAP, TS_ST_OK, 1), TS_MSG_SHARD_MAP_MAX);
    assert_string_equal(ts__op_name(TS_OP_SHARD_MAP), "SHARD_MAP");
}

static void test_wrong_shard(void **state)
{
    (void)state;
    uint8_t buf[TS_MAX_ERRMSG + 1], again[TS_MAX_ERRMSG];
    ts__msg_wrong_shard w = {6867, 1, 4, (const uint8_t *)"h2:8000", 7, "not mine", 8};
    size_t len = 0;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, 30, &w, &len), TS_EMSGSIZE);
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &w, &len), 0);
    assert_int_equal(len, 16 + 7 + 8);
    static const uint8_t head[16] = {0xD3, 0x1A, 0x01, 0x00, 0x07, 0x00, 0x00, 0x00,
                                     0x04, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00};
    assert_memory_equal(buf, head, 16);
    assert_memory_equal(buf + 16, "h2:8000not mine", 15);
    /* Through the table: any opcode's WRONG_SHARD, but opcode 0's. */
    ts__msg m;
    assert_int_equal(ts__msg_reply_decode(TS_OP_PUT, TS_ST_WRONG_SHARD, buf, len, &m), 0);
    assert_int_equal(m.kind, TS_MSG_WRONG_SHARD);
    assert_int_equal(m.u.wrong_shard.slot, 6867);
    assert_int_equal(m.u.wrong_shard.owner, 1);
    assert_int_equal(m.u.wrong_shard.epoch, 4);
    assert_int_equal(m.u.wrong_shard.addr_len, 7);
    assert_memory_equal(m.u.wrong_shard.msg, "not mine", 8);
    size_t n = 0;
    assert_int_equal(ts__msg_encode(&m, again, sizeof(again), &n), 0);
    assert_int_equal(n, len);
    assert_memory_equal(again, buf, len);
    assert_int_equal(ts__msg_reply_kind(0, TS_ST_WRONG_SHARD), TS_MSG_ERROR);
    assert_int_equal(ts__msg_reply_kind(TS_OP_MGET, TS_ST_WRONG_SHARD), TS_MSG_WRONG_SHARD);
    assert_int_equal(ts__msg_reply_limit(TS_OP_GET, TS_ST_WRONG_SHARD, 1 << 30), TS_MAX_ERRMSG);
    ts__msg_wrong_shard d;
    for (size_t k = 0; k < 16 + 7; k++)
        assert_int_equal(ts__msg_wrong_shard_decode(buf, k, &d), TS_EPROTO);
    assert_int_equal(ts__msg_wrong_shard_decode(buf, 16 + 7, &d), 0);
    assert_int_equal(d.msg_len, 0);

    /* No address, owner known (--shard I/N) or not. */
    ts__msg_wrong_shard u = {1, 2, 1, NULL, 0, "x", 1};
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &u, &len), 0);
    assert_int_equal(ts__msg_wrong_shard_decode(buf, len, &d), 0);
    assert_int_equal(d.owner, 2);
    u.owner = TS_SHARD_NONE;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &u, &len), 0);
    assert_int_equal(ts__msg_wrong_shard_decode(buf, len, &d), 0);

    /* The encoder's refusals. */
    ts__msg_wrong_shard e = w;
    e.slot = TS_SLOTS;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &e, &len), TS_EINVAL);
    e = w;
    e.epoch = 0;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &e, &len), TS_EINVAL);
    e = w;
    e.owner = TS_SHARD_NONE;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &e, &len), TS_EINVAL);
    e = w;
    static char longmsg[TS_MAX_ERRMSG];
    memset(longmsg, 'm', sizeof(longmsg));
    e.msg = longmsg;
    e.msg_len = TS_MAX_ERRMSG - 16 - 7;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &e, &len), 0);
    assert_int_equal(len, TS_MAX_ERRMSG);
    assert_int_equal(ts__msg_wrong_shard_decode(buf, len, &d), 0);
    e.msg_len++;
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &e, &len), TS_EINVAL);

    /* The decoder's refusals, field by field. */
    assert_int_equal(ts__msg_wrong_shard_encode(buf, sizeof(buf), &w, &len), 0);
    buf[len] = 'x';
    assert_int_equal(ts__msg_wrong_shard_decode(buf, TS_MAX_ERRMSG + 1, &d), TS_EPROTO);
    uint8_t b[64];
    memcpy(b, buf, len);
    ts__put_u16le(b, TS_SLOTS);
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    ts__put_u16le(b + 6, 1);
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    ts__put_u64le(b + 8, 0);
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    ts__put_u16le(b + 2, TS_SHARD_NONE);
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    ts__put_u16le(b + 2, TS_SHARD_MAX);
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    ts__put_u16le(b + 4, (uint16_t)(len - 15));
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
    memcpy(b, buf, len);
    b[17] = '\n';
    assert_int_equal(ts__msg_wrong_shard_decode(b, len, &d), TS_EPROTO);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shard_map_round_trips),
        cmocka_unit_test(test_shard_map_refused),
        cmocka_unit_test(test_wrong_shard),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
