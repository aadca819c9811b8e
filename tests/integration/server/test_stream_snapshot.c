/*
 * Streams across a restart with --save (snapshot format 2): a stream with records and a marker,
 * two fan-out groups at different cursors, a work queue with pending entries, a partial ack and
 * a member that left, and retention settings comes back after SAVE and SIGTERM with the same
 * ids, the same entries byte for byte and the same cursors; reads resume with the pending
 * entries first (redelivered, with their delivery counts and rows done), then the new ones;
 * appends go on at last_id + 1. A stream whose entries were all trimmed keeps its ids. A
 * format 1 snapshot (tensorshare 0.3, no streams) still loads, and a stream section that breaks
 * a rule with every checksum right, or a bin and a stream of one name, is refused with exit
 * status 3 and a line naming the file and the rule.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "msg.h"
#include "record.h"
#include "snapfile_fix.h"
#include "test_harden_util.h"

static th_saving sv; /* the tensord under test, saving into sv.snap */
static uint32_t rid = 1;

static int teardown(void **state)
{
    (void)state;
    th_saving_teardown(&sv);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * Stream requests through the codec
 */

static uint32_t send_body(int fd, uint8_t op, const uint8_t *body, size_t len)
{
    uint32_t id = rid++;
    assert_int_equal(tsh_send(fd, op, id, body, len), 0);
    return id;
}

static void expect_ok(int fd, uint8_t op, uint32_t id, tsu_frame *f)
{
    tsu_expect(fd, f, op, id, TS_ST_OK);
}

static void create(int fd, const char *name, uint64_t max_entries, uint64_t max_bytes,
                   uint32_t max_age_ms, uint32_t window, uint32_t lease_ms)
{
    ts__msg_stream_create_req m = {.name = (const uint8_t *)name,
                                   .name_len = strlen(name),
                                   .max_entries = max_entries,
                                   .max_bytes = max_bytes,
                                   .max_age_ms = max_age_ms,
                                   .window = window,
                                   .lease_ms = lease_ms};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_create_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_CREATE, send_body(fd, TS_OP_STREAM_CREATE, body, len), &f);
    tsu_frame_free(&f);
}

/* STREAM_APPEND of rec; returns the new entry's id. */
static uint64_t append(int fd, const char *name, const uint8_t *rec, size_t len)
{
    uint32_t id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, name, rec, len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_APPEND, id, &f);
    ts__msg_stream_append_state a;
    assert_int_equal(ts__msg_stream_append_state_decode(f.body, f.len, &a), 0);
    tsu_frame_free(&f);
    return a.id;
}

static uint64_t mark(int fd, const char *name, uint64_t tag)
{
    ts__msg_stream_mark_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .tag = tag};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_mark_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_MARK, send_body(fd, TS_OP_STREAM_MARK, body, len), &f);
    ts__msg_stream_append_state a;
    assert_int_equal(ts__msg_stream_append_state_decode(f.body, f.len, &a), 0);
    tsu_frame_free(&f);
    return a.id;
}

static ts__msg_stream_member_req member_req(const char *name, const char *group, const char *member)
{
    ts__msg_stream_member_req m;
    memset(&m, 0, sizeof(m));
    m.name = (const uint8_t *)name;
    m.name_len = strlen(name);
    m.group = (const uint8_t *)group;
    m.group_len = strlen(group);
    m.member = (const uint8_t *)member;
    m.member_len = strlen(member);
    return m;
}

static ts__msg_stream_join_state join(int fd, const char *name, const char *group,
                                      const char *member)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.start = TS_STREAM_START_OLDEST;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_join_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_JOIN, send_body(fd, TS_OP_STREAM_JOIN, body, len), &f);
    ts__msg_stream_join_state js;
    assert_int_equal(ts__msg_stream_join_state_decode(f.body, f.len, &js), 0);
    tsu_frame_free(&f);
    return js;
}

/* An ENTRIES reply, kept whole: the entries point into f.body. */
typedef struct batch {
    tsu_frame f;
    uint32_t n;
    uint64_t first_id, last_id;
    ts__msg_stream_entry e[64];
} batch;

static void recv_batch(int fd, uint8_t op, uint32_t id, batch *b)
{
    expect_ok(fd, op, id, &b->f);
    ts__msg_stream_entries m;
    assert_int_equal(ts__msg_stream_entries_decode(b->f.body, b->f.len, &m), 0);
    assert_true(m.n <= 64);
    b->n = m.n;
    b->first_id = m.first_id;
    b->last_id = m.last_id;
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entries_iter_init(&m, &it);
    for (uint32_t i = 0; i < m.n; i++)
        assert_int_equal(ts__msg_stream_entries_next(&m, &it, &b->e[i]), 1);
}

/* STREAM_READ (no ack, no wait) of up to max entries. */
static void read_b(int fd, const char *name, const char *group, const char *member, uint32_t max,
                   batch *b)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.max_entries = max;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_read_req_encode(body, sizeof(body), &m, &len), 0);
    recv_batch(fd, TS_OP_STREAM_READ, send_body(fd, TS_OP_STREAM_READ, body, len), b);
}

static void read_status(int fd, const char *name, const char *group, const char *member,
                        uint16_t status)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.max_entries = 1;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_read_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_STREAM_READ, send_body(fd, TS_OP_STREAM_READ, body, len), status);
    tsu_frame_free(&f);
}

static void ack(int fd, const char *name, const char *group, const char *member, uint64_t first,
                uint64_t last, uint32_t rows)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.first = first;
    m.last = last;
    m.rows = rows;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_ack_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_ACK, send_body(fd, TS_OP_STREAM_ACK, body, len), &f);
    tsu_frame_free(&f);
}

static void leave(int fd, const char *name, const char *group, const char *member)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_leave_req_encode(body, sizeof(body), &m, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_LEAVE, send_body(fd, TS_OP_STREAM_LEAVE, body, len), &f);
    tsu_frame_free(&f);
}

static void range_b(int fd, const char *name, uint64_t after, uint32_t max, batch *b)
{
    ts__msg_stream_range_req m = {.name = (const uint8_t *)name,
                                  .name_len = strlen(name),
                                  .after_id = after,
                                  .max_entries = max};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_range_req_encode(body, sizeof(body), &m, &len), 0);
    recv_batch(fd, TS_OP_STREAM_RANGE, send_body(fd, TS_OP_STREAM_RANGE, body, len), b);
}

/* An int of STREAM_INFO's map. */
static int64_t info_int(int fd, const char *name, const char *key)
{
    uint32_t id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_STREAM_INFO, id, name, NULL, 0), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_STREAM_INFO, id, &f);
    uint8_t *buf = ts__malloc_aligned(f.len);
    assert_non_null(buf);
    memcpy(buf, f.body, f.len);
    ts__rbuf *rb = ts__rbuf_new(buf, f.len, NULL);
    assert_non_null(rb);
    ts_value_t *root = ts__record_decode(rb, 0, f.len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    assert_non_null(root);
    int64_t v = -1;
    assert_int_equal(ts_map_get_int(root, key, &v), 0);
    ts__record_tree_free(root);
    tsu_frame_free(&f);
    return v;
}

/* Check an entry handed out by READ. */
static void expect_entry(const ts__msg_stream_entry *e, uint64_t id, uint16_t deliveries,
                         uint32_t rows_done, int redelivered)
{
    if (e->id != id || e->deliveries != deliveries || e->rows_done != rows_done ||
        !!(e->flags & TS_STREAM_ENTRY_REDELIVERED) != redelivered) {
        print_error("entry %llu: deliveries %u rows_done %u flags %u; want %llu %u %u %d\n",
                    (unsigned long long)e->id, e->deliveries, e->rows_done, e->flags,
                    (unsigned long long)id, deliveries, rows_done, redelivered);
        fail();
    }
}

/* ---------------------------------------------------------------------------------------------
 * Cases
 */

#define N_ENTRIES 10
#define MARK_ID   6
#define BIG_ID    7

static const char *const info_keys[] = {"first_id",   "last_id",     "entries",
                                        "bytes",      "max_entries", "max_bytes",
                                        "max_age_ms", "window",      "lease_ms"};

static void test_streams_survive_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    int fd = tsu_client(&sv.srv);
    /* Retention settings that keep everything here (an hour of age, a MiB of records). */
    create(fd, "events", 100, 1 << 20, 3600000, 50, 60000);
    /* Ids 1..10: ints, a marker (6), a 100 KB record (7), ints. */
    uint8_t *rec[N_ENTRIES + 1] = {NULL};
    size_t rlen[N_ENTRIES + 1] = {0};
    for (uint64_t id = 1; id <= N_ENTRIES; id++) {
        if (id == MARK_ID) {
            assert_int_equal(mark(fd, "events", 42), id);
            continue;
        }
        rec[id] = id == BIG_ID ? tsu_rec_bytes(100000, 9, &rlen[id])
                               : tsu_rec_int((int64_t)id * 11, &rlen[id]);
        assert_int_equal(append(fd, "events", rec[id], rlen[id]), id);
    }
    batch b;
    /* fan-a: 1..3 handed out, 1..2 acknowledged: 3 pending, next_id 4. */
    join(fd, "events", "fan-a", "a");
    read_b(fd, "events", "fan-a", "a", 3, &b);
    assert_int_equal(b.n, 3);
    tsu_frame_free(&b.f);
    ack(fd, "events", "fan-a", "a", 1, 2, 0);
    /* fan-b: 1..7 handed out and acknowledged: nothing pending, next_id 8. */
    join(fd, "events", "fan-b", "b");
    read_b(fd, "events", "fan-b", "b", 7, &b);
    assert_int_equal(b.n, 7);
    tsu_frame_free(&b.f);
    ack(fd, "events", "fan-b", "b", 1, 7, 0);
    /*
     * A work queue: w1 gets 1, 2 and acknowledges 1, then rejoins and gets 2 again (two
     * deliveries); w2 gets 3, 4 and has used 5 rows of 3; w3 gets 5 and leaves (5 is orphaned).
     */
    join(fd, "events", "wq", "w1");
    join(fd, "events", "wq", "w2");
    join(fd, "events", "wq", "w3");
    read_b(fd, "events", "wq", "w1", 2, &b);
    assert_int_equal(b.n, 2);
    tsu_frame_free(&b.f);
    read_b(fd, "events", "wq", "w2", 2, &b);
    assert_int_equal(b.n, 2);
    tsu_frame_free(&b.f);
    read_b(fd, "events", "wq", "w3", 1, &b);
    expect_entry(&b.e[0], 5, 1, 0, 0);
    tsu_frame_free(&b.f);
    ack(fd, "events", "wq", "w1", 1, 1, 0);
    ack(fd, "events", "wq", "w2", 3, 3, 5);
    leave(fd, "events", "wq", "w3");
    join(fd, "events", "wq", "w1");
    read_b(fd, "events", "wq", "w1", 1, &b);
    expect_entry(&b.e[0], 2, 2, 0, 1);
    tsu_frame_free(&b.f);
    int64_t before[TS__ARRAY_SIZE(info_keys)];
    for (size_t k = 0; k < TS__ARRAY_SIZE(info_keys); k++)
        before[k] = info_int(fd, "events", info_keys[k]);
    assert_int_equal(before[0], 1);
    assert_int_equal(before[1], N_ENTRIES);
    /* SAVE, then a clean stop (its final snapshot changes nothing) and a restart. */
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, rid, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, rid++, TS_ST_OK);
    tsu_frame_free(&f);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);

    /* The same settings, ids and sizes; the same entries, byte for byte. */
    for (size_t k = 0; k < TS__ARRAY_SIZE(info_keys); k++)
        assert_int_equal(info_int(fd, "events", info_keys[k]), before[k]);
    range_b(fd, "events", 0, 64, &b);
    assert_int_equal(b.n, N_ENTRIES);
    assert_int_equal(b.first_id, 1);
    assert_int_equal(b.last_id, N_ENTRIES);
    for (uint32_t i = 0; i < b.n; i++) {
        uint64_t id = i + 1;
        assert_int_equal(b.e[i].id, id);
        if (id == MARK_ID) {
            assert_int_equal(b.e[i].kind, TS_STREAM_ENTRY_MARKER);
            assert_int_equal(b.e[i].tag, 42);
            continue;
        }
        assert_int_equal(b.e[i].kind, TS_STREAM_ENTRY_RECORD);
        assert_int_equal(b.e[i].len, rlen[id]);
        assert_memory_equal(b.e[i].record, rec[id], rlen[id]);
    }
    tsu_frame_free(&b.f);

    /*
     * fan-a reads without joining again (members are live from the load): its pending 3 first,
     * redelivered by the load, then the entries after its cursor.
     */
    read_b(fd, "events", "fan-a", "a", 64, &b);
    assert_int_equal(b.n, N_ENTRIES - 2);
    expect_entry(&b.e[0], 3, 2, 0, 1);
    for (uint32_t i = 1; i < b.n; i++)
        expect_entry(&b.e[i], 3 + i, 1, 0, 0);
    tsu_frame_free(&b.f);
    read_b(fd, "events", "fan-b", "b", 64, &b);
    assert_int_equal(b.n, 3);
    for (uint32_t i = 0; i < b.n; i++)
        expect_entry(&b.e[i], 8 + i, 1, 0, 0);
    tsu_frame_free(&b.f);
    /* The work queue: w2's own entries with the rows it had done, the orphan, then new ones. */
    ts__msg_stream_join_state js = join(fd, "events", "wq", "w2");
    assert_int_equal(js.next_id, 6);
    assert_int_equal(js.floor, 2);
    assert_int_equal(js.pending, 2);
    assert_int_equal(js.members, 2);
    assert_int_equal(js.rows_done, 5);
    read_b(fd, "events", "wq", "w2", 64, &b);
    assert_int_equal(b.n, 8);
    expect_entry(&b.e[0], 3, 2, 5, 1);
    expect_entry(&b.e[1], 4, 2, 0, 1);
    expect_entry(&b.e[2], 5, 2, 0, 1);
    for (uint32_t i = 3; i < b.n; i++)
        expect_entry(&b.e[i], 3 + i, 1, 0, 0);
    tsu_frame_free(&b.f);
    read_b(fd, "events", "wq", "w1", 64, &b);
    assert_int_equal(b.n, 1);
    expect_entry(&b.e[0], 2, 3, 0, 1);
    tsu_frame_free(&b.f);
    /* w3 had left: it is no member any more. */
    read_status(fd, "events", "wq", "w3", TS_ST_NOT_FOUND);
    /* Appends go on after the last id. */
    size_t l;
    uint8_t *r = tsu_rec_int(-1, &l);
    assert_int_equal(append(fd, "events", r, l), N_ENTRIES + 1);
    tsu_rec_free(r, l);
    assert_int_equal(mark(fd, "events", 43), N_ENTRIES + 2);
    read_b(fd, "events", "fan-b", "b", 64, &b);
    assert_int_equal(b.n, 2);
    expect_entry(&b.e[0], N_ENTRIES + 1, 1, 0, 0);
    tsu_frame_free(&b.f);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    for (uint64_t id = 1; id <= N_ENTRIES; id++)
        if (rec[id] != NULL)
            tsu_rec_free(rec[id], rlen[id]);
}

static void test_trimmed_stream_keeps_ids(void **state)
{
    (void)state;
    th_saving_start(&sv);
    int fd = tsu_client(&sv.srv);
    /* Each record is larger than max_bytes: retention drops it as soon as it is in. */
    create(fd, "trimmed", 10, 20, 0, 0, 0);
    join(fd, "trimmed", "g", "m");
    size_t l;
    uint8_t *r = tsu_rec_bytes(64, 3, &l);
    for (int i = 0; i < 3; i++)
        assert_int_equal(append(fd, "trimmed", r, l), (uint64_t)i + 1);
    assert_int_equal(info_int(fd, "trimmed", "first_id"), 4);
    assert_int_equal(info_int(fd, "trimmed", "last_id"), 3);
    assert_int_equal(info_int(fd, "trimmed", "entries"), 0);
    close(fd);
    /* No SAVE: the final snapshot at SIGTERM holds it. */
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    assert_int_equal(info_int(fd, "trimmed", "first_id"), 4);
    assert_int_equal(info_int(fd, "trimmed", "last_id"), 3);
    assert_int_equal(info_int(fd, "trimmed", "max_bytes"), 20);
    ts__msg_stream_join_state js = join(fd, "trimmed", "g", "m");
    assert_int_equal(js.next_id, 4);
    assert_int_equal(js.lost, 3);
    assert_int_equal(js.pending, 0);
    assert_int_equal(mark(fd, "trimmed", 7), 4);
    batch b;
    read_b(fd, "trimmed", "g", "m", 64, &b);
    assert_int_equal(b.n, 1);
    assert_int_equal(b.e[0].id, 4);
    assert_int_equal(b.e[0].tag, 7);
    tsu_frame_free(&b.f);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    tsu_rec_free(r, l);
}

/* A format 1 snapshot written before streams (a fuzz seed) loads; the next one is format 2. */
static void test_format_1_loads(void **state)
{
    (void)state;
    th_saving_start(&sv);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t len;
    char *old = tsh_read_source_file("tests/fuzz/corpus/fuzz_snapfile/four_bins", &len);
    assert_non_null(old);
    assert_int_equal(ts__get_u32le((const uint8_t *)old + 8), 1);
    assert_int_equal(th_write_file(sv.snap, old, len), 0);
    th_saving_restart(&sv);
    int fd = tsu_client(&sv.srv);
    assert_int_equal(tsu_stat(fd, "bins"), 4);
    assert_int_equal(tsu_stat(fd, "items"), 6);
    create(fd, "after", 5, 0, 0, 0, 0);
    assert_int_equal(mark(fd, "after", 1), 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    uint8_t *now = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(now + 8), TSD_SNAP_FORMAT);
    free(now);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    assert_int_equal(tsu_stat(fd, "items"), 6);
    assert_int_equal(info_int(fd, "after", "last_id"), 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    free(old);
}

/* The record of the clash file's bin. */
static void clash_item(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const tsu_frame *rec = arg;
    assert_int_equal(index, 0);
    *data = rec->body;
    *len = rec->len;
}

/* A file (written by the format's own writer) with a bin "q" and a stream "q" of one marker. */
static uint8_t *clash_file(size_t *len)
{
    size_t rl;
    uint8_t *r = tsu_rec_int(1, &rl);
    tsu_frame rec = {.body = r, .len = rl};
    tsd_snapfile_bin bin = {
        .name = (const uint8_t *)"q", .name_len = 1, .version = 1, .n_items = 1};
    uint8_t table[TSD_SNAP_ENTRY_SIZE];
    tsd_snapfile_entry_put(table, 0, 0, 9, 0);
    tsd_snapfile_stream st = {.name = (const uint8_t *)"q",
                              .name_len = 1,
                              .max_entries = 10,
                              .lease_ms = 1000,
                              .first_id = 1,
                              .last_id = 1,
                              .entries = table};
    tsd_snapfile_head head = {.counter = 1, .n_bins = 1, .n_items = 1, .bytes = rl, .n_streams = 1};
    FILE *f = tmpfile();
    assert_non_null(f);
    assert_int_equal(tsd_snapfile_write(fileno(f), &head, &bin, &st, clash_item, &rec), 0);
    long n = lseek(fileno(f), 0, SEEK_END);
    assert_true(n > 0);
    uint8_t *b = ts__malloc((size_t)n);
    assert_non_null(b);
    assert_int_equal(pread(fileno(f), b, (size_t)n, 0), n);
    fclose(f);
    tsu_rec_free(r, rl);
    *len = (size_t)n;
    return b;
}

/*
 * A rule broken with every checksum right, and a byte flipped in the streams section. With
 * TS_STREAM_SEED set, the good file is copied there: the fuzz seed fuzz_snapfile/streams.
 */
static void test_broken_streams_refused(void **state)
{
    (void)state;
    th_saving_start(&sv);
    int fd = tsu_client(&sv.srv);
    create(fd, "q", 10, 0, 0, 0, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(mark(fd, "q", (uint64_t)i), (uint64_t)i + 1);
    size_t rl;
    uint8_t *r = tsu_rec_int(5, &rl);
    assert_int_equal(append(fd, "q", r, rl), 5);
    tsu_rec_free(r, rl);
    join(fd, "q", "grp", "m1");
    join(fd, "q", "grp", "m2");
    join(fd, "q", "grp", "m3");
    batch b;
    read_b(fd, "q", "grp", "m1", 2, &b);
    tsu_frame_free(&b.f);
    read_b(fd, "q", "grp", "m2", 2, &b);
    tsu_frame_free(&b.f);
    read_b(fd, "q", "grp", "m3", 1, &b);
    tsu_frame_free(&b.f);
    ack(fd, "q", "grp", "m2", 4, 4, 2);
    leave(fd, "q", "grp", "m3");
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t len;
    uint8_t *good = th_read_file(sv.snap, &len);
    const char *seed = getenv("TS_STREAM_SEED");
    if (seed != NULL)
        assert_int_equal(th_write_file(seed, good, len), 0);
    uint8_t *bad = ts__malloc(len);
    assert_non_null(bad);
    /* m2's pending table holds 3 then 4: make its 3 a 1, which m1 holds too. */
    const uint8_t *m2 = memmem(good, len, "\x02m2", 3);
    assert_non_null(m2);
    size_t row = (size_t)(m2 - good) + 3 + 8 + 8;
    assert_int_equal(ts__get_u64le(good + row), 3);
    memcpy(bad, good, len);
    ts__put_u64le(bad + row, 1);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "group 'grp' of stream 'q': entry 1 is pending twice");
    /* The same row pointing past the group's cursor. */
    memcpy(bad, good, len);
    ts__put_u64le(bad + row, 7);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "pending id 7 is not above");
    /* A flipped bit in the stream's name (no bins: the stream follows the section's header). */
    size_t name = TSD_SNAP_HDR_SIZE + TSD_SNAP_SEC_SIZE + 1;
    assert_int_equal(good[name], 'q');
    memcpy(bad, good, len);
    bad[name] ^= 0x01;
    th_saving_expect_refused(&sv, bad, len, "checksum mismatch in the header of stream 0");
    /* A bin and a stream of one name: each is good, together they are not. */
    size_t clash_len;
    uint8_t *clash = clash_file(&clash_len);
    th_saving_expect_refused(&sv, clash, clash_len, "bin 'q' is also a stream");
    ts__free(clash);
    /* The good one still loads. */
    assert_int_equal(th_write_file(sv.snap, good, len), 0);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    assert_int_equal(info_int(fd, "q", "last_id"), 5);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    ts__free(bad);
    free(good);
}

/* ---------------------------------------------------------------------------------------------
 * Replay tables (format 3)
 */

static ts__msg_table_state table_call(int fd, uint8_t op, const uint8_t *body, size_t len)
{
    tsu_frame f;
    expect_ok(fd, op, send_body(fd, op, body, len), &f);
    ts__msg_table_state st;
    assert_int_equal(ts__msg_table_state_decode(f.body, f.len, &st), 0);
    tsu_frame_free(&f);
    return st;
}

static void table_create(int fd, const char *name, uint64_t capacity, uint8_t sampler,
                         uint8_t remover, double spi, double eb, uint32_t max_times)
{
    ts__msg_table_create_req q = {.name = (const uint8_t *)name,
                                  .name_len = strlen(name),
                                  .capacity = capacity,
                                  .min_size_to_sample = 1,
                                  .samples_per_insert = spi,
                                  .error_buffer = eb,
                                  .priority_exponent = 1.0,
                                  .max_times_sampled = max_times,
                                  .remover = remover,
                                  .sampler = sampler};
    uint8_t body[512];
    size_t len = 0;
    assert_int_equal(ts__msg_table_create_req_encode(body, sizeof(body), &q, &len), 0);
    (void)table_call(fd, TS_OP_TABLE_CREATE, body, len);
}

/* Insert the record of int v with priority p; returns the key. */
static uint64_t table_insert(int fd, const char *name, int64_t v, double p)
{
    size_t rl;
    uint8_t *r = tsu_rec_int(v, &rl);
    uint8_t fixed[TS_MSG_TABLE_INSERT_FIXED];
    ts__msg_table_insert_fixed fx = {.priority = p, .timeout_ms = 0};
    ts__msg_table_insert_fixed_encode(fixed, &fx);
    size_t cap = 1 + strlen(name) + sizeof(fixed) + rl, len = 0;
    uint8_t *body = ts__malloc(cap);
    assert_non_null(body);
    assert_int_equal(ts__msg_upload_encode(body, cap, (const uint8_t *)name, strlen(name), fixed,
                                           sizeof(fixed), r, rl, &len),
                     0);
    ts__msg_table_state st = table_call(fd, TS_OP_TABLE_INSERT, body, len);
    ts__free(body);
    tsu_rec_free(r, rl);
    return st.key;
}

/* Draw up to n; returns how many came (the reply's sample count). */
static uint32_t table_sample(int fd, const char *name, uint32_t n)
{
    ts__msg_table_sample_req q = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .n = n, .timeout_ms = 0};
    uint8_t body[300];
    size_t len = 0;
    assert_int_equal(ts__msg_table_sample_req_encode(body, sizeof(body), &q, &len), 0);
    tsu_frame f;
    expect_ok(fd, TS_OP_TABLE_SAMPLE, send_body(fd, TS_OP_TABLE_SAMPLE, body, len), &f);
    ts__msg_table_samples m;
    assert_int_equal(ts__msg_table_samples_decode(f.body, f.len, &m), 0);
    uint32_t got = m.n;
    tsu_frame_free(&f);
    return got;
}

/* TABLE_UPDATE of keys[0..n) to priorities p: the state (done = the keys the table holds). */
static ts__msg_table_state table_update(int fd, const char *name, uint32_t n, const uint64_t *keys,
                                        const double *p)
{
    uint8_t body[4096];
    size_t len = 0;
    assert_int_equal(ts__msg_table_keys_req_encode(body, sizeof(body), (const uint8_t *)name,
                                                   strlen(name), n, keys, p, &len),
                     0);
    return table_call(fd, TS_OP_TABLE_UPDATE, body, len);
}

/*
 * Replay tables survive a restart from the snapshot: their settings, items (keys, priorities,
 * records), sizes and the counters the rate limiter works from; sampling goes on; a LIST shows
 * them as before.
 */
static void test_tables_survive_restart(void **state)
{
    (void)state;
    th_saving_start(&sv);
    int fd = tsu_client(&sv.srv);
    /* A FIFO table that has evicted (capacity 4, 6 inserts) and a prioritized one sampled. */
    table_create(fd, "fifo", 4, TS_TABLE_SAMPLER_FIFO, TS_TABLE_REMOVER_FIFO, 1.0, 0.0, 0);
    for (int i = 0; i < 6; i++)
        assert_int_equal(table_insert(fd, "fifo", i, 1.0), (uint64_t)i + 1);
    table_create(fd, "prio", 100, TS_TABLE_SAMPLER_PRIORITIZED, TS_TABLE_REMOVER_LOWEST, 1.0, 10.0,
                 0);
    uint64_t keys[5];
    double prio[5] = {0.5, 1.0, 2.0, 3.0, 0.0};
    for (int i = 0; i < 5; i++)
        keys[i] = table_insert(fd, "prio", 100 + i, prio[i]);
    assert_int_equal(table_sample(fd, "prio", 3), 3);
    table_create(fd, "empty", 10, TS_TABLE_SAMPLER_UNIFORM, TS_TABLE_REMOVER_FIFO, 1.0, 0.0, 0);
    ts__msg_table_state before = table_update(fd, "prio", 0, NULL, NULL);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t len;
    uint8_t *file = th_read_file(sv.snap, &len);
    assert_int_equal(ts__get_u32le(file + 8), TSD_SNAP_FORMAT);
    free(file);

    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    ts__msg_table_state st = table_update(fd, "fifo", 0, NULL, NULL);
    assert_int_equal(st.size, 4);
    assert_int_equal(st.inserts, 6);
    /* FIFO order kept: the oldest held is the third insert (int 2). */
    tsu_frame f;
    ts__msg_table_sample_req q = {
        .name = (const uint8_t *)"fifo", .name_len = 4, .n = 1, .timeout_ms = 0};
    uint8_t body[300];
    size_t bl = 0;
    assert_int_equal(ts__msg_table_sample_req_encode(body, sizeof(body), &q, &bl), 0);
    expect_ok(fd, TS_OP_TABLE_SAMPLE, send_body(fd, TS_OP_TABLE_SAMPLE, body, bl), &f);
    ts__msg_table_samples m;
    assert_int_equal(ts__msg_table_samples_decode(f.body, f.len, &m), 0);
    ts__msg_table_sample e;
    ts__msg_table_sample_get(&m, 0, &e);
    assert_int_equal(e.key, 3);
    tsu_frame_free(&f);
    /* The prioritized table: the same counters, every key held, new inserts get later keys. */
    st = table_update(fd, "prio", 5, keys, prio);
    assert_int_equal(st.size, before.size);
    assert_int_equal(st.inserts, before.inserts);
    assert_int_equal(st.samples, before.samples);
    assert_int_equal(st.done, 5);
    assert_true(table_insert(fd, "prio", 200, 1.0) > keys[4]);
    assert_true(table_sample(fd, "prio", 2) >= 1);
    st = table_update(fd, "empty", 0, NULL, NULL);
    assert_int_equal(st.size, 0);
    /* Tables are not bins. */
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    /*
     * Item changes alone (no table made or deleted, no bin changed since the snapshot loaded)
     * are changes a snapshot holds: an insert, samples and new priorities survive the next
     * restart too.
     */
    double prio2[5] = {4.0, 0.25, 2.5, 1.5, 0.75};
    assert_int_equal(table_update(fd, "prio", 5, keys, prio2).done, 5);
    before = table_update(fd, "prio", 0, NULL, NULL);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    st = table_update(fd, "prio", 0, NULL, NULL);
    assert_int_equal(st.size, before.size);
    assert_int_equal(st.inserts, before.inserts);
    assert_int_equal(st.samples, before.samples);
    /* The new priorities: a draw's probability is its priority over their sum (10, with the
     * item of priority 1 inserted after the first restart). */
    tsu_frame f2;
    q = (ts__msg_table_sample_req){
        .name = (const uint8_t *)"prio", .name_len = 4, .n = 1, .timeout_ms = 0};
    assert_int_equal(ts__msg_table_sample_req_encode(body, sizeof(body), &q, &bl), 0);
    expect_ok(fd, TS_OP_TABLE_SAMPLE, send_body(fd, TS_OP_TABLE_SAMPLE, body, bl), &f2);
    assert_int_equal(ts__msg_table_samples_decode(f2.body, f2.len, &m), 0);
    ts__msg_table_sample_get(&m, 0, &e);
    double want = 1.0;
    for (int i = 0; i < 5; i++)
        if (e.key == keys[i])
            want = prio2[i];
    assert_true(fabs(e.probability - want / 10.0) < 1e-9);
    tsu_frame_free(&f2);
    /* An insert alone after a load is kept too. */
    uint64_t k = table_insert(fd, "prio", 300, 1.0);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    th_saving_restart(&sv);
    fd = tsu_client(&sv.srv);
    st = table_update(fd, "prio", 1, &k, prio2);
    assert_int_equal(st.done, 1);
    assert_int_equal(st.inserts, before.inserts + 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
}

/* A damaged replay table section is refused as other damaged sections are: exit 3, named. */
static void test_broken_tables_refused(void **state)
{
    (void)state;
    th_saving_start(&sv);
    int fd = tsu_client(&sv.srv);
    table_create(fd, "tbl", 8, TS_TABLE_SAMPLER_UNIFORM, TS_TABLE_REMOVER_FIFO, 1.0, 0.0, 0);
    for (int i = 0; i < 3; i++)
        (void)table_insert(fd, "tbl", i, 1.0 + i);
    close(fd);
    assert_int_equal(tsh_server_stop(&sv.srv), 0);
    size_t len;
    uint8_t *good = th_read_file(sv.snap, &len);
    uint8_t *bad = ts__malloc(len);
    assert_non_null(bad);
    const uint8_t *sec = memmem(good, len, "TSDTABL", 8);
    assert_non_null(sec);
    size_t hdr = (size_t)(sec - good) + TSD_SNAP_SEC_SIZE; /* the table's header */
    size_t rows = hdr + 1 + 3 + 88 + 8;                    /* its item table */
    /* A flipped bit in the table's name: its header's checksum fails. */
    memcpy(bad, good, len);
    bad[hdr + 1] ^= 0x01;
    th_saving_expect_refused(&sv, bad, len, "checksum mismatch in the header of replay table 0");
    /* Keys out of order, every checksum right. */
    memcpy(bad, good, len);
    ts__put_u64le(bad + rows + TSD_SNAP_TITEM_SIZE, 9);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len,
                             "item 1 of replay table 'tbl' (key 9) breaks a rule of tables");
    /* Counters that disagree with the items held. */
    memcpy(bad, good, len);
    ts__put_u64le(bad + hdr + 1 + 3 + 56, 7);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "do not agree");
    /* A priority the table refuses (negative). */
    memcpy(bad, good, len);
    uint64_t neg;
    double d = -1.0;
    memcpy(&neg, &d, sizeof(neg));
    ts__put_u64le(bad + rows + 8, neg);
    snapfix_rehash(bad, len);
    th_saving_expect_refused(&sv, bad, len, "breaks a rule of tables");
    ts__free(bad);
    free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_streams_survive_restart, teardown),
        cmocka_unit_test_teardown(test_trimmed_stream_keeps_ids, teardown),
        cmocka_unit_test_teardown(test_format_1_loads, teardown),
        cmocka_unit_test_teardown(test_broken_streams_refused, teardown),
        cmocka_unit_test_teardown(test_tables_survive_restart, teardown),
        cmocka_unit_test_teardown(test_broken_tables_refused, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
