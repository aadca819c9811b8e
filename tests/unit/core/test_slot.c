/*
 * Slots and shard maps (src/slot.c, docs/PROTOCOL.md section 14): the CRC's check values, the
 * hash tags, the default split, and the map file parser's accepted and refused inputs (each
 * refusal names its line).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "common.h"
#include "slot.h"

static uint16_t slot_of(const char *name)
{
    return ts__slot(name, strlen(name));
}

static void test_crc(void **state)
{
    (void)state;
    assert_int_equal(ts__crc16_xmodem("123456789", 9), 0x31C3);
    assert_int_equal(ts__crc16_xmodem("", 0), 0);
    assert_int_equal(ts__crc16_xmodem("A", 1), 0x58E5);
}

static void test_hash_tags(void **state)
{
    (void)state;
    /* The spec's check values. */
    assert_int_equal(slot_of("{exp7}.params"), 6867);
    assert_int_equal(slot_of("params"), 1749);
    assert_int_equal(slot_of("{}params"), 3613);
    /* A tag: only the bytes between the first '{' and the first '}' after it. */
    assert_int_equal(slot_of("{exp7}.grads"), slot_of("exp7"));
    assert_int_equal(slot_of("a{exp7}b{other}c"), slot_of("exp7"));
    assert_int_equal(slot_of("x{exp7}"), slot_of("exp7"));
    /* An empty tag hashes the whole name, so "{}a" and "{}b" need not share a slot. */
    assert_int_equal(slot_of("{}params"), ts__crc16_xmodem("{}params", 8) % TS_SLOTS);
    assert_int_not_equal(slot_of("{}a"), slot_of("{}b"));
    /* A '{' without a '}' after it: the whole name. */
    assert_int_equal(slot_of("{exp7"), ts__crc16_xmodem("{exp7", 5) % TS_SLOTS);
    assert_int_equal(slot_of("}exp7{"), ts__crc16_xmodem("}exp7{", 6) % TS_SLOTS);
    assert_int_equal(slot_of("{"), ts__crc16_xmodem("{", 1) % TS_SLOTS);
    /* Nested braces: the key runs from the first '{' to the first '}', braces included. */
    assert_int_equal(slot_of("{{a}}"), slot_of("{a"));
    assert_int_equal(slot_of("{a{b}c}"), slot_of("a{b"));
    /* A '}' before the '{' does not end the tag. */
    assert_int_equal(slot_of("}{k}"), slot_of("k"));
    /* The empty name. */
    assert_int_equal(ts__slot("", 0), 0);
    assert_int_equal(ts__slot(NULL, 0), 0);
    /* Names may hold any byte, NUL included. */
    assert_int_equal(ts__slot("{a\0b}", 5), ts__crc16_xmodem("a\0b", 3) % TS_SLOTS);
    for (int i = 0; i < 1000; i++) {
        char name[32];
        int n = snprintf(name, sizeof(name), "bin-%d", i);
        assert_true(ts__slot(name, (size_t)n) < TS_SLOTS);
    }
}

/* Every slot owned exactly by the ranges of its owner, and the ranges sorted and merged. */
static void check_ranges(const ts__shard_map *m)
{
    uint32_t covered = 0;
    assert_int_equal(m->range_off[0], 0);
    assert_int_equal(m->range_off[m->n_shards], m->n_ranges);
    for (uint32_t i = 0; i < m->n_shards; i++) {
        assert_true(m->range_off[i + 1] > m->range_off[i]);
        for (uint32_t r = m->range_off[i]; r < m->range_off[i + 1]; r++) {
            assert_true(m->ranges[r].first <= m->ranges[r].last);
            if (r > m->range_off[i])
                assert_true(m->ranges[r].first > m->ranges[r - 1].last + 1);
            for (uint32_t s = m->ranges[r].first; s <= m->ranges[r].last; s++)
                assert_int_equal(m->owner[s], i);
            covered += (uint32_t)(m->ranges[r].last - m->ranges[r].first) + 1;
        }
    }
    assert_int_equal(covered, TS_SLOTS);
}

static void test_default_split(void **state)
{
    (void)state;
    static const uint32_t ns[] = {1, 2, 3, 7, 16, 1000, TS_SHARD_MAX};
    for (size_t k = 0; k < TS__ARRAY_SIZE(ns); k++) {
        uint32_t n = ns[k];
        ts__shard_map *m = NULL;
        assert_int_equal(ts__shard_map_default(n, NULL, 1, &m), 0);
        assert_int_equal(m->n_shards, n);
        assert_int_equal(m->n_ranges, n);
        assert_int_equal(m->epoch, 1);
        for (uint32_t i = 0; i < n; i++) {
            assert_string_equal(m->addrs[i], "");
            assert_int_equal(m->ranges[i].first, (uint64_t)i * TS_SLOTS / n);
            assert_int_equal(m->ranges[i].last, (uint64_t)(i + 1) * TS_SLOTS / n - 1);
        }
        check_ranges(m);
        ts__shard_map_free(m);
    }
    /* Three shards: 0-5460, 5461-10921, 10922-16383. */
    const char *addrs[] = {"h1:8000", "h2:8000", "[::1]:8000"};
    ts__shard_map *m = NULL;
    assert_int_equal(ts__shard_map_default(3, addrs, 0, &m), 0);
    assert_int_equal(m->ranges[0].last, 5460);
    assert_int_equal(m->ranges[1].first, 5461);
    assert_int_equal(m->ranges[1].last, 10921);
    assert_int_equal(m->ranges[2].first, 10922);
    assert_string_equal(m->addrs[2], "[::1]:8000");
    assert_int_equal(ts__shard_map_owner(m, 6867), 1);
    ts__shard_map_free(m);
    /* Out of range. */
    assert_int_equal(ts__shard_map_default(0, NULL, 1, &m), TS_EINVAL);
    assert_int_equal(ts__shard_map_default(TS_SHARD_MAX + 1, NULL, 1, &m), TS_EINVAL);
    const char *bad[] = {"h1:1", "h 2:1"};
    assert_int_equal(ts__shard_map_default(2, bad, 1, &m), TS_EINVAL);
    ts__shard_map_free(NULL);
}

static void test_from_owners(void **state)
{
    (void)state;
    static uint16_t owner[TS_SLOTS];
    /* Interleaved: shard s % 2, so 16384 ranges in all. */
    for (uint32_t s = 0; s < TS_SLOTS; s++)
        owner[s] = (uint16_t)(s % 2);
    ts__shard_map *m = NULL;
    assert_int_equal(ts__shard_map_from_owners(2, owner, NULL, 9, &m), 0);
    assert_int_equal(m->n_ranges, TS_SLOTS);
    check_ranges(m);
    ts__shard_map_free(m);
    /* A shard without slots, and an owner out of range. */
    memset(owner, 0, sizeof(owner));
    assert_int_equal(ts__shard_map_from_owners(2, owner, NULL, 1, &m), TS_EINVAL);
    owner[5] = 2;
    assert_int_equal(ts__shard_map_from_owners(2, owner, NULL, 1, &m), TS_EINVAL);
}

/* Parse text; expect success. */
static ts__shard_map *parse_ok(const char *text)
{
    char err[TS_SHARD_MAP_ERR_MAX];
    ts__shard_map *m = NULL;
    int rc = ts__shard_map_parse(text, strlen(text), &m, err, sizeof(err));
    if (rc != 0)
        fail_msg("refused: %s\n%s", err, text);
    check_ranges(m);
    return m;
}

/* Parse text; expect a refusal whose message starts with prefix (e.g. "line 3:"). */
static void parse_bad(const char *text, const char *prefix)
{
    char err[TS_SHARD_MAP_ERR_MAX];
    ts__shard_map *m = NULL;
    int rc = ts__shard_map_parse(text, strlen(text), &m, err, sizeof(err));
    if (rc != TS_EINVAL)
        fail_msg("accepted (%d): %s", rc, text);
    if (strncmp(err, prefix, strlen(prefix)) != 0)
        fail_msg("message '%s' does not start with '%s'", err, prefix);
}

static void test_parse_accept(void **state)
{
    (void)state;
    ts__shard_map *m = parse_ok("# three shards\n"
                                "h1:8000\n"
                                "\n"
                                "  h2:8000   # the second\n"
                                "tcp://h3:8000\r\n");
    assert_int_equal(m->n_shards, 3);
    assert_int_equal(m->epoch, 1);
    assert_string_equal(m->addrs[0], "h1:8000");
    assert_string_equal(m->addrs[1], "h2:8000");
    assert_string_equal(m->addrs[2], "tcp://h3:8000");
    ts__shard_map *d = NULL;
    assert_int_equal(ts__shard_map_default(3, (const char *const *)m->addrs, 1, &d), 0);
    assert_true(ts__shard_map_same(m, d));
    ts__shard_map_free(d);
    ts__shard_map_free(m);

    /* Ranges in any order, split and merged, an epoch anywhere, no final newline. */
    m = parse_ok("[::1]:7001 0-99,8000-16383\n"
                 "epoch 42\n"
                 "tls://b:7002\t100-4999,5000-7999");
    assert_int_equal(m->epoch, 42);
    assert_int_equal(m->n_shards, 2);
    assert_int_equal(m->n_ranges, 3);
    assert_int_equal(ts__shard_map_owner(m, 99), 0);
    assert_int_equal(ts__shard_map_owner(m, 100), 1);
    assert_int_equal(ts__shard_map_owner(m, 7999), 1);
    assert_int_equal(ts__shard_map_owner(m, 8000), 0);
    assert_int_equal(m->ranges[m->range_off[1]].first, 100);
    assert_int_equal(m->ranges[m->range_off[1]].last, 7999);
    ts__shard_map_free(m);

    m = parse_ok("epoch 18446744073709551615\nonly:1 0-16383\n");
    assert_int_equal(m->epoch, UINT64_MAX);
    assert_int_equal(m->n_shards, 1);
    ts__shard_map_free(m);

    /* 1024 shards by line order. */
    size_t cap = TS_SHARD_MAX * 32, len = 0;
    char *text = malloc(cap);
    assert_non_null(text);
    for (uint32_t i = 0; i < TS_SHARD_MAX; i++)
        len += (size_t)snprintf(text + len, cap - len, "host%u:7000\n", i);
    m = parse_ok(text);
    assert_int_equal(m->n_shards, TS_SHARD_MAX);
    ts__shard_map_free(m);
    /* One more is refused on its line. */
    (void)snprintf(text + len, cap - len, "extra:1\n");
    parse_bad(text, "line 1025:");
    free(text);
}

static void test_parse_reject(void **state)
{
    (void)state;
    parse_bad("", "line 1: end of file: no shard lines");
    parse_bad("# nothing\n\n", "line 2: end of file");
    parse_bad("epoch 3\n", "line 1: end of file");
    parse_bad("a:1\nepoch 0\n", "line 2:");
    parse_bad("a:1\nepoch x\n", "line 2:");
    parse_bad("a:1\nepoch 18446744073709551616\n", "line 2:");
    parse_bad("epoch 1\na:1\nepoch 2\n", "line 3: a second epoch line (the first is line 1)");
    parse_bad("epoch\na:1\n", "line 1:");
    parse_bad("epoch 1 2\na:1\n", "line 1:");
    /* Mixed ranged and unranged lines. */
    parse_bad("a:1 0-100\nb:1\n", "line 2:");
    parse_bad("a:1\nb:1 0-100\n", "line 2:");
    /* Holes and overlaps. */
    parse_bad("a:1 0-100\nb:1 101-16382\n", "line 2: end of file: slots 16383-16383");
    parse_bad("a:1 0-100\nb:1 100-16383\n", "line 2: slot 100 is already owned by line 1");
    parse_bad("a:1 0-100,50-60\nb:1 101-16383\n", "line 1: slot 50");
    parse_bad("a:1 5-16383\n", "line 1: end of file: slots 0-4");
    /* Malformed ranges. */
    parse_bad("a:1 0-16384\n", "line 1:");
    parse_bad("a:1 10-5\n", "line 1: range 10-5");
    parse_bad("a:1 0-\n", "line 1:");
    parse_bad("a:1 -5\n", "line 1:");
    parse_bad("a:1 0-5,\n", "line 1:");
    parse_bad("a:1 0-5,,6-9\n", "line 1:");
    parse_bad("a:1 7\n", "line 1:");
    parse_bad("a:1 0-5x\n", "line 1:");
    parse_bad("a:1 +0-16383\n", "line 1:");
    parse_bad("a:1 0-99999999999999999999999\n", "line 1:");
    parse_bad("a:1 0-100 101-16383\n", "line 1:");
    /* Addresses. */
    parse_bad("a:1\na:1\n", "line 2: address a:1 is also on line 1");
    parse_bad("a:1\ntcp://a:1\n", "line 2: address tcp://a:1 is also on line 1");
    parse_bad("tcp://a:1\na:1\n", "line 2: address a:1 is also on line 1");
    parse_bad("a,b:1\n", "line 1:");
    parse_bad("a:1\n\x01:1\n", "line 2:");
    parse_bad("a:1\n\xc3\xa9:1\n", "line 2:");
    char longaddr[TS_SHARD_ADDR_MAX + 8];
    memset(longaddr, 'x', TS_SHARD_ADDR_MAX + 1);
    longaddr[TS_SHARD_ADDR_MAX + 1] = '\n';
    longaddr[TS_SHARD_ADDR_MAX + 2] = '\0';
    parse_bad(longaddr, "line 1: the address is longer");
    longaddr[TS_SHARD_ADDR_MAX] = '\n';
    longaddr[TS_SHARD_ADDR_MAX + 1] = '\0';
    ts__shard_map *m = parse_ok(longaddr);
    assert_int_equal(strlen(m->addrs[0]), TS_SHARD_ADDR_MAX);
    ts__shard_map_free(m);
    /* A NUL byte inside the text. */
    char err[TS_SHARD_MAP_ERR_MAX];
    assert_int_equal(ts__shard_map_parse("a:1\nb\0:1\n", 9, &m, err, sizeof(err)), TS_EINVAL);
    assert_string_equal(err, "line 2: a NUL byte");
    /* No error buffer: the same refusal. */
    assert_int_equal(ts__shard_map_parse("a:1\na:1\n", 8, &m, NULL, 0), TS_EINVAL);
}

static void test_load(void **state)
{
    (void)state;
    char path[] = "/tmp/test_slot_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char *text = "epoch 7\nh1:1\nh2:2\n";
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    char err[TS_SHARD_MAP_ERR_MAX];
    ts__shard_map *m = NULL;
    assert_int_equal(ts__shard_map_load(path, &m, err, sizeof(err)), 0);
    assert_int_equal(m->epoch, 7);
    assert_int_equal(m->n_shards, 2);
    ts__shard_map_free(m);
    /* A bad line: the message names the file and the line. */
    assert_int_equal(ftruncate(fd, 0), 0);
    assert_int_equal(pwrite(fd, "h1:1 0-5\n", 9, 0), 9);
    assert_int_equal(ts__shard_map_load(path, &m, err, sizeof(err)), TS_EINVAL);
    assert_non_null(strstr(err, path));
    assert_non_null(strstr(err, "line 1: end of file: slots 6-16383"));
    /* Too large: refused before parsing. */
    assert_int_equal(ftruncate(fd, (off_t)TS_SHARD_MAP_FILE_MAX + 1), 0);
    assert_int_equal(ts__shard_map_load(path, &m, err, sizeof(err)), TS_EINVAL);
    assert_non_null(strstr(err, "larger than"));
    (void)close(fd);
    (void)unlink(path);
    /* Missing, and not a regular file. */
    assert_int_equal(ts__shard_map_load(path, &m, err, sizeof(err)), TS_EINVAL);
    assert_non_null(strstr(err, "No such file"));
    assert_int_equal(ts__shard_map_load("/tmp", &m, err, sizeof(err)), TS_EINVAL);
    assert_non_null(strstr(err, "not a regular file"));
}

/* Every allocation of the parser and the builders fails cleanly (no leak under ASan). */
static void test_alloc_failures(void **state)
{
    (void)state;
    const char *text = "epoch 3\na:1 0-10,20-16383\nb:1 11-19\n";
    int ok = 0;
    for (long n = 1; n < 100 && !ok; n++) {
        ts__shard_map *m = NULL;
        ts__alloc_fail_after(n);
        int rc = ts__shard_map_parse(text, strlen(text), &m, NULL, 0);
        ts__alloc_fail_after(-1);
        if (rc == 0) {
            ok = 1;
            ts__shard_map_free(m);
        } else {
            assert_int_equal(rc, TS_ENOMEM);
        }
    }
    assert_true(ok);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crc),           cmocka_unit_test(test_hash_tags),
        cmocka_unit_test(test_default_split), cmocka_unit_test(test_from_owners),
        cmocka_unit_test(test_parse_accept),  cmocka_unit_test(test_parse_reject),
        cmocka_unit_test(test_load),          cmocka_unit_test(test_alloc_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
