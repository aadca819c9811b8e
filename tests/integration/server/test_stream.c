/*
 * Streams over raw sockets (STREAM_* opcodes 0x16 to 0x1F, status BACKPRESSURE): dense ids and
 * RANGE, retention by count, bytes and age, blocking RANGE and READ, fan-out groups, a late
 * joiner, redelivery after a rejoin, ack_through, credits released by an ack and by a lease,
 * a work queue of two members, claims after a lease, LEAVE, partial acks, markers, WAIT and
 * LISTEN, LIST (inline and off-loop), name clashes both ways, bad input that changes nothing,
 * DELETE and shutdown with pending waits, and --max-watch. Each case starts its own tensord.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <signal.h>
#include <sys/stat.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "msg.h"
#include "record.h"
#include "test_server_util.h"

static tsh_server srv;
static uint32_t rid = 1;

static int start(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int stop(void **state)
{
    (void)state;
    int rc = 0;
    if (srv.pid > 0)
        rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * Requests through the codec
 */

static uint32_t send_body(int fd, uint8_t op, const uint8_t *body, size_t len)
{
    uint32_t id = rid++;
    assert_int_equal(tsh_send(fd, op, id, body, len), 0);
    return id;
}

/* Receive the reply to (op, id) with status; the frame is the caller's. */
static void expect(int fd, tsu_frame *f, uint8_t op, uint32_t id, uint16_t status)
{
    tsu_expect(fd, f, op, id, status);
}

static uint32_t send_create(int fd, const char *name, uint64_t max_entries, uint64_t max_bytes,
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
    return send_body(fd, TS_OP_STREAM_CREATE, body, len);
}

static void state_of(const tsu_frame *f, ts__msg_stream_state *st)
{
    assert_int_equal(ts__msg_stream_state_decode(f->body, f->len, st), 0);
}

/* CREATE that must succeed; returns the STREAM STATE. */
static ts__msg_stream_state create(int fd, const char *name, uint64_t max_entries,
                                   uint64_t max_bytes, uint32_t max_age_ms, uint32_t window,
                                   uint32_t lease_ms)
{
    uint32_t id = send_create(fd, name, max_entries, max_bytes, max_age_ms, window, lease_ms);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_CREATE, id, TS_ST_OK);
    ts__msg_stream_state st;
    state_of(&f, &st);
    tsu_frame_free(&f);
    return st;
}

static uint32_t send_append(int fd, const char *name, int64_t v)
{
    size_t len;
    uint8_t *rec = tsu_rec_int(v, &len);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, name, rec, len), 0);
    tsu_rec_free(rec, len);
    return id;
}

/* APPEND of tsu_rec_int(v) answered with status; the APPEND STATE when OK. */
static ts__msg_stream_append_state append_st(int fd, const char *name, int64_t v, uint16_t status)
{
    uint32_t id = send_append(fd, name, v);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_APPEND, id, status);
    ts__msg_stream_append_state a;
    memset(&a, 0, sizeof(a));
    if (status == TS_ST_OK)
        assert_int_equal(ts__msg_stream_append_state_decode(f.body, f.len, &a), 0);
    tsu_frame_free(&f);
    return a;
}

static uint64_t append(int fd, const char *name, int64_t v)
{
    return append_st(fd, name, v, TS_ST_OK).id;
}

static ts__msg_stream_append_state mark(int fd, const char *name, uint64_t tag, uint16_t status)
{
    ts__msg_stream_mark_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .tag = tag};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_mark_req_encode(body, sizeof(body), &m, &len), 0);
    uint32_t id = send_body(fd, TS_OP_STREAM_MARK, body, len);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_MARK, id, status);
    ts__msg_stream_append_state a;
    memset(&a, 0, sizeof(a));
    if (status == TS_ST_OK)
        assert_int_equal(ts__msg_stream_append_state_decode(f.body, f.len, &a), 0);
    tsu_frame_free(&f);
    return a;
}

static uint32_t send_credit(int fd, const char *name, uint32_t timeout_ms)
{
    ts__msg_stream_credit_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .timeout_ms = timeout_ms};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_credit_req_encode(body, sizeof(body), &m, &len), 0);
    return send_body(fd, TS_OP_STREAM_CREDIT, body, len);
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
    m.member_len = member != NULL ? strlen(member) : 0;
    return m;
}

static uint32_t send_join(int fd, const char *name, const char *group, const char *member,
                          uint8_t start, uint32_t lease_ms)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.start = start;
    m.lease_ms = lease_ms;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_join_req_encode(body, sizeof(body), &m, &len), 0);
    return send_body(fd, TS_OP_STREAM_JOIN, body, len);
}

static ts__msg_stream_join_state join(int fd, const char *name, const char *group,
                                      const char *member, uint8_t start, uint32_t lease_ms)
{
    uint32_t id = send_join(fd, name, group, member, start, lease_ms);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_JOIN, id, TS_ST_OK);
    ts__msg_stream_join_state js;
    assert_int_equal(ts__msg_stream_join_state_decode(f.body, f.len, &js), 0);
    tsu_frame_free(&f);
    return js;
}

static uint32_t send_read(int fd, const char *name, const char *group, const char *member,
                          uint64_t ack_through, uint32_t max, uint32_t timeout_ms)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.ack_through = ack_through;
    m.max_entries = max;
    m.timeout_ms = timeout_ms;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_read_req_encode(body, sizeof(body), &m, &len), 0);
    return send_body(fd, TS_OP_STREAM_READ, body, len);
}

/* A decoded ENTRIES reply: up to 64 entries, each record's int (or -1 for a marker). */
typedef struct batch {
    uint64_t first_id, last_id, lost;
    uint32_t n;
    ts__msg_stream_entry e[64];
    int64_t v[64];
} batch;

static void entries_of(const tsu_frame *f, batch *b)
{
    ts__msg_stream_entries m;
    assert_int_equal(ts__msg_stream_entries_decode(f->body, f->len, &m), 0);
    assert_true(m.n <= 64);
    b->first_id = m.first_id;
    b->last_id = m.last_id;
    b->lost = m.lost;
    b->n = m.n;
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entries_iter_init(&m, &it);
    for (uint32_t i = 0; i < m.n; i++) {
        assert_int_equal(ts__msg_stream_entries_next(&m, &it, &b->e[i]), 1);
        b->v[i] = b->e[i].kind == TS_STREAM_ENTRY_MARKER
                      ? -1
                      : tsu_item_int(b->e[i].record, (size_t)b->e[i].len);
    }
}

/* Receive the ENTRIES reply to a READ/RANGE sent as (op, id). */
static void recv_entries(int fd, uint8_t op, uint32_t id, batch *b)
{
    tsu_frame f;
    expect(fd, &f, op, id, TS_ST_OK);
    entries_of(&f, b);
    tsu_frame_free(&f);
}

static void read_b(int fd, const char *name, const char *group, const char *member,
                   uint64_t ack_through, uint32_t max, uint32_t timeout_ms, batch *b)
{
    uint32_t id = send_read(fd, name, group, member, ack_through, max, timeout_ms);
    recv_entries(fd, TS_OP_STREAM_READ, id, b);
}

static uint32_t send_ack(int fd, const char *name, const char *group, const char *member,
                         uint64_t first, uint64_t last, uint32_t rows)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    m.first = first;
    m.last = last;
    m.rows = rows;
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_ack_req_encode(body, sizeof(body), &m, &len), 0);
    return send_body(fd, TS_OP_STREAM_ACK, body, len);
}

static ts__msg_stream_ack_state ack(int fd, const char *name, const char *group, const char *member,
                                    uint64_t first, uint64_t last, uint32_t rows)
{
    uint32_t id = send_ack(fd, name, group, member, first, last, rows);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_ACK, id, TS_ST_OK);
    ts__msg_stream_ack_state as;
    assert_int_equal(ts__msg_stream_ack_state_decode(f.body, f.len, &as), 0);
    tsu_frame_free(&f);
    return as;
}

static void leave(int fd, const char *name, const char *group, const char *member, uint16_t status)
{
    ts__msg_stream_member_req m = member_req(name, group, member);
    uint8_t body[1024];
    size_t len;
    assert_int_equal(ts__msg_stream_leave_req_encode(body, sizeof(body), &m, &len), 0);
    uint32_t id = send_body(fd, TS_OP_STREAM_LEAVE, body, len);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_LEAVE, id, status);
    tsu_frame_free(&f);
}

static uint32_t send_range(int fd, const char *name, uint64_t after, uint32_t max,
                           uint32_t timeout_ms)
{
    ts__msg_stream_range_req m = {.name = (const uint8_t *)name,
                                  .name_len = strlen(name),
                                  .after_id = after,
                                  .max_entries = max,
                                  .timeout_ms = timeout_ms};
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_stream_range_req_encode(body, sizeof(body), &m, &len), 0);
    return send_body(fd, TS_OP_STREAM_RANGE, body, len);
}

static void range_b(int fd, const char *name, uint64_t after, uint32_t max, uint32_t timeout_ms,
                    batch *b)
{
    uint32_t id = send_range(fd, name, after, max, timeout_ms);
    recv_entries(fd, TS_OP_STREAM_RANGE, id, b);
}

/* Expect (op, id) answered with status (an error: the connection stays usable). */
static void expect_status(int fd, uint8_t op, uint32_t id, uint16_t status)
{
    tsu_frame f;
    expect(fd, &f, op, id, status);
    tsu_frame_free(&f);
}

/* STREAM_INFO's record as a tree (free with ts__record_tree_free; its buffer with the tree). */
static ts_value_t *info(int fd, const char *name)
{
    uint32_t id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_STREAM_INFO, id, name, NULL, 0), 0);
    tsu_frame f;
    expect(fd, &f, TS_OP_STREAM_INFO, id, TS_ST_OK);
    assert_int_equal(ts__record_validate(f.body, f.len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL), 0);
    uint8_t *copy = ts__malloc_aligned(f.len);
    assert_non_null(copy);
    memcpy(copy, f.body, f.len);
    ts__rbuf *rb = ts__rbuf_new(copy, f.len, NULL);
    assert_non_null(rb);
    ts_value_t *root = ts__record_decode(rb, 0, f.len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    assert_non_null(root);
    tsu_frame_free(&f);
    return root;
}

static int64_t info_int(int fd, const char *name, const char *key)
{
    ts_value_t *root = info(fd, name);
    int64_t v = 0;
    assert_int_equal(ts_map_get_int(root, key, &v), 0);
    ts__record_tree_free(root);
    return v;
}

/* Check that b holds ids first..first+n-1 with values first-1.. (append(v) with v = id - 1). */
static void expect_ids(const batch *b, uint64_t first, uint32_t n)
{
    assert_int_equal(b->n, n);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(b->e[i].id, first + i);
        assert_int_equal(b->v[i], (int64_t)(first + i - 1));
    }
}

/*
 * Wait (at most 5 s, polling STATS) until n requests wait on streams: requests sent on other
 * connections are then known to be parked before the test goes on.
 */
static void wait_for_waits(int fd, int64_t n)
{
    for (int i = 0; i < 500; i++) {
        if (tsu_stat(fd, "stream_waits") == n)
            return;
        sleep_ms(10);
    }
    assert_int_equal(tsu_stat(fd, "stream_waits"), n);
}

static void ping(int fd)
{
    uint32_t id = send_body(fd, TS_OP_PING, NULL, 0);
    expect_status(fd, TS_OP_PING, id, TS_ST_OK);
}

/* ---------------------------------------------------------------------------------------------
 * Cases
 */

/* Dense ids from 1, RANGE in order (also from the middle and with a cap), INFO, STATS. */
static void test_dense_ids_and_range(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    ts__msg_stream_state st = create(fd, "s", 100, 0, 0, 0, 0);
    assert_int_equal(st.first_id, 1);
    assert_int_equal(st.last_id, 0);
    assert_int_equal(st.n_entries, 0);
    assert_int_equal(st.credit, UINT32_MAX);
    for (int i = 0; i < 5; i++) {
        ts__msg_stream_append_state a = append_st(fd, "s", i, TS_ST_OK);
        assert_int_equal(a.id, (uint64_t)i + 1);
        assert_int_equal(a.first_id, 1);
        assert_int_equal(a.n_entries, (uint32_t)i + 1);
        assert_int_equal(a.credit, UINT32_MAX);
    }
    batch b;
    range_b(fd, "s", 0, 100, 0, &b);
    assert_int_equal(b.first_id, 1);
    assert_int_equal(b.last_id, 5);
    assert_int_equal(b.lost, 0);
    expect_ids(&b, 1, 5);
    for (uint32_t i = 0; i < b.n; i++) {
        assert_int_equal(b.e[i].kind, TS_STREAM_ENTRY_RECORD);
        assert_int_equal(b.e[i].deliveries, 0);
        assert_int_equal(b.e[i].flags, 0);
    }
    range_b(fd, "s", 3, 100, 0, &b);
    expect_ids(&b, 4, 2);
    range_b(fd, "s", 1, 2, 0, &b);
    expect_ids(&b, 2, 2);
    /* Nothing after the newest: at once with 0 entries. */
    range_b(fd, "s", 5, 10, 0, &b);
    assert_int_equal(b.n, 0);
    /* Creating it again keeps it (and its entries). */
    st = create(fd, "s", 100, 0, 0, 0, 0);
    assert_int_equal(st.last_id, 5);
    assert_int_equal(st.n_entries, 5);
    assert_int_equal(info_int(fd, "s", "entries"), 5);
    assert_int_equal(info_int(fd, "s", "credit"), -1);
    assert_int_equal(tsu_stat(fd, "streams"), 1);
    assert_int_equal(tsu_stat(fd, "stream_entries"), 5);
    assert_true(tsu_stat(fd, "stream_bytes") > 0);
    assert_int_equal(tsu_stat(fd, "ops_stream_append"), 5);
    close(fd);
}

/* Retention by count, by bytes, and by age (after an append and from the cron). */
static void test_retention(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    create(fd, "count", 3, 0, 0, 0, 0);
    for (int i = 0; i < 5; i++)
        append(fd, "count", i);
    batch b;
    range_b(fd, "count", 0, 100, 0, &b);
    assert_int_equal(b.first_id, 3);
    expect_ids(&b, 3, 3);
    /* Lowering max_entries applies at once. */
    ts__msg_stream_state st = create(fd, "count", 1, 0, 0, 0, 0);
    assert_int_equal(st.first_id, 5);
    assert_int_equal(st.n_entries, 1);

    size_t rlen;
    uint8_t *rec = tsu_rec_int(0, &rlen);
    tsu_rec_free(rec, rlen);
    /* Room for exactly two records. */
    create(fd, "bytes", 100, 2 * rlen, 0, 0, 0);
    for (int i = 0; i < 4; i++)
        append(fd, "bytes", i);
    range_b(fd, "bytes", 0, 100, 0, &b);
    expect_ids(&b, 3, 2);
    st = create(fd, "bytes", 100, 2 * rlen, 0, 0, 0);
    assert_int_equal(st.bytes, 2 * rlen);

    create(fd, "age", 100, 0, 200, 0, 0);
    append(fd, "age", 0);
    append(fd, "age", 1);
    sleep_ms(300);
    /* The append drops what is older than 200 ms, never the newest. */
    ts__msg_stream_append_state a = append_st(fd, "age", 2, TS_ST_OK);
    assert_int_equal(a.first_id, 3);
    assert_int_equal(a.n_entries, 1);
    append(fd, "age", 3);
    /* The cron (every 500 ms) drops aged entries without an append; the newest stays. */
    sleep_ms(900);
    range_b(fd, "age", 0, 100, 0, &b);
    expect_ids(&b, 4, 1);
    close(fd);
}

/* A RANGE waiting is woken by an append; one that times out gets 0 entries. */
static void test_range_blocking(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "s", 10, 0, 0, 0, 0);
    append(fd, "s", 0);
    uint32_t id = send_range(w, "s", 1, 10, 5000);
    sleep_ms(50);
    append(fd, "s", 1);
    batch b;
    recv_entries(w, TS_OP_STREAM_RANGE, id, &b);
    expect_ids(&b, 2, 1);
    range_b(w, "s", 2, 10, 100, &b);
    assert_int_equal(b.n, 0);
    assert_int_equal(b.last_id, 2);
    assert_int_equal(tsu_stat(fd, "stream_waits"), 0);
    close(w);
    close(fd);
}

/* Two groups each get every entry exactly once and in order (ack_through as they go). */
static void test_fan_out(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 0, 0);
    join(fd, "s", "a", "a", TS_STREAM_START_OLDEST, 0);
    join(fd, "s", "b", "b", TS_STREAM_START_OLDEST, 0);
    uint64_t next[2] = {1, 1};
    const char *g[2] = {"a", "b"};
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < 5; i++)
            append(fd, "s", round * 5 + i);
        for (int k = 0; k < 2; k++) {
            batch b;
            /* Reads of 3: every entry once, in order, acknowledged by the next read. */
            for (int r = 0; r < 3; r++) {
                read_b(fd, "s", g[k], g[k], next[k] - 1, 3, 0, &b);
                for (uint32_t i = 0; i < b.n; i++) {
                    assert_int_equal(b.e[i].id, next[k]);
                    assert_int_equal(b.v[i], (int64_t)next[k] - 1);
                    assert_int_equal(b.e[i].deliveries, 1);
                    assert_int_equal(b.e[i].flags, 0);
                    next[k]++;
                }
            }
        }
    }
    assert_int_equal(next[0], 21);
    assert_int_equal(next[1], 21);
    close(fd);
}

/* A group joined with NEWEST sees only what comes after; rejoin redelivers unacked first. */
static void test_newest_and_rejoin(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 0, 0);
    for (int i = 0; i < 3; i++)
        append(fd, "s", i);
    ts__msg_stream_join_state js = join(fd, "s", "late", "m", TS_STREAM_START_NEWEST, 0);
    assert_int_equal(js.next_id, 4);
    assert_int_equal(js.floor, 4);
    batch b;
    read_b(fd, "s", "late", "m", 0, 10, 0, &b);
    assert_int_equal(b.n, 0);
    append(fd, "s", 3);
    read_b(fd, "s", "late", "m", 0, 10, 0, &b);
    expect_ids(&b, 4, 1);

    /* A consumer reads 1..3, acknowledges 1 (ack_through of the next read), then restarts. */
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    read_b(fd, "s", "g", "m", 0, 3, 0, &b);
    expect_ids(&b, 1, 3);
    read_b(fd, "s", "g", "m", 1, 1, 0, &b);
    expect_ids(&b, 4, 1);
    js = join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    assert_int_equal(js.pending, 3);
    assert_int_equal(js.floor, 2);
    assert_int_equal(js.next_id, 5);
    append(fd, "s", 4);
    /* Redelivered first, in id order, then the new one. */
    read_b(fd, "s", "g", "m", 0, 10, 0, &b);
    assert_int_equal(b.n, 4);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(b.e[i].id, 2 + i);
        assert_int_equal(b.e[i].deliveries, 2);
        assert_int_equal(b.e[i].flags, TS_STREAM_ENTRY_REDELIVERED);
    }
    assert_int_equal(b.e[3].id, 5);
    assert_int_equal(b.e[3].flags, 0);
    /* ack_through acknowledges this member's pending entries up to it. */
    read_b(fd, "s", "g", "m", 4, 10, 0, &b);
    assert_int_equal(b.n, 0);
    ts__msg_stream_ack_state as = ack(fd, "s", "g", "m", 5, 5, 0);
    assert_int_equal(as.acked, 1);
    assert_int_equal(as.pending, 0);
    assert_int_equal(as.floor, 6);
    close(fd);
}

/* Credits: BACKPRESSURE at the window, CREDIT released by an ack and by a lease expiry. */
static void test_credits(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 2, 0);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    assert_int_equal(append_st(fd, "s", 0, TS_ST_OK).credit, 1);
    assert_int_equal(append_st(fd, "s", 1, TS_ST_OK).credit, 0);
    append_st(fd, "s", 2, TS_ST_BACKPRESSURE);
    /* Nothing changed, the connection stays, and markers ignore the credit. */
    assert_int_equal(mark(fd, "s", 9, TS_ST_OK).id, 3);
    assert_int_equal(tsu_stat(fd, "stream_backpressure"), 1);
    /* CREDIT without a timeout: credit 0 at once. */
    uint32_t id = send_credit(w, "s", 0);
    tsu_frame f;
    expect(w, &f, TS_OP_STREAM_CREDIT, id, TS_ST_OK);
    ts__msg_stream_state st;
    state_of(&f, &st);
    tsu_frame_free(&f);
    assert_int_equal(st.credit, 0);
    assert_int_equal(st.window, 2);
    /* A waiting CREDIT is answered when the group acknowledges. */
    id = send_credit(w, "s", 5000);
    batch b;
    read_b(fd, "s", "g", "m", 0, 2, 0, &b);
    expect_ids(&b, 1, 2);
    ack(fd, "s", "g", "m", 1, 2, 0);
    expect(w, &f, TS_OP_STREAM_CREDIT, id, TS_ST_OK);
    state_of(&f, &st);
    tsu_frame_free(&f);
    assert_true(st.credit >= 1);
    assert_int_equal(st.n_stale, 0);

    /* A group on a 400 ms lease that stops reading holds the credit until its lease ends. */
    create(fd, "t", 100, 0, 0, 2, 0);
    join(fd, "t", "slow", "m", TS_STREAM_START_OLDEST, 400);
    append(fd, "t", 0);
    append(fd, "t", 1);
    append_st(fd, "t", 2, TS_ST_BACKPRESSURE);
    id = send_credit(w, "t", 5000);
    expect(w, &f, TS_OP_STREAM_CREDIT, id, TS_ST_OK);
    state_of(&f, &st);
    tsu_frame_free(&f);
    /* Answered before its timeout (which would give credit 0): the group went stale. */
    assert_int_equal(st.credit, UINT32_MAX);
    assert_int_equal(st.n_stale, 1);
    assert_int_equal(tsu_stat(fd, "stream_groups_stale"), 1);
    append(fd, "t", 2);
    /* It reads again: live again, holding the producer back once more. */
    read_b(fd, "t", "slow", "m", 0, 1, 0, &b);
    expect_ids(&b, 1, 1);
    append_st(fd, "t", 3, TS_ST_BACKPRESSURE);
    /* A CREDIT whose timeout passes first gets credit 0. */
    id = send_credit(w, "t", 50);
    expect(w, &f, TS_OP_STREAM_CREDIT, id, TS_ST_OK);
    state_of(&f, &st);
    tsu_frame_free(&f);
    assert_int_equal(st.credit, 0);
    close(w);
    close(fd);
}

/* A work queue: one group, two members, each entry to exactly one; claims after a lease. */
static void test_work_queue(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "q", 100, 0, 0, 0, 0);
    join(fd, "q", "g", "m1", TS_STREAM_START_OLDEST, 500);
    join(fd, "q", "g", "m2", TS_STREAM_START_OLDEST, 0);
    for (int i = 0; i < 10; i++)
        append(fd, "q", i);
    batch b1, b2;
    read_b(fd, "q", "g", "m1", 0, 4, 0, &b1);
    read_b(fd, "q", "g", "m2", 0, 4, 0, &b2);
    expect_ids(&b1, 1, 4);
    expect_ids(&b2, 5, 4);
    read_b(fd, "q", "g", "m2", 8, 10, 0, &b2);
    expect_ids(&b2, 9, 2);
    ack(fd, "q", "g", "m2", 9, 10, 0);
    /* m1 is live: nothing of it may be taken. */
    read_b(fd, "q", "g", "m2", 0, 10, 0, &b2);
    assert_int_equal(b2.n, 0);
    /* m1 stops reading: m2's waiting read is woken when m1's lease ends, with m1's entries. */
    uint32_t id = send_read(w, "q", "g", "m2", 0, 10, 5000);
    recv_entries(w, TS_OP_STREAM_READ, id, &b2);
    expect_ids(&b2, 1, 4);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(b2.e[i].flags, TS_STREAM_ENTRY_REDELIVERED);
        assert_int_equal(b2.e[i].deliveries, 2);
    }
    /* m1 comes back: its entries are gone to m2. */
    ts__msg_stream_join_state js = join(fd, "q", "g", "m1", TS_STREAM_START_OLDEST, 0);
    assert_int_equal(js.pending, 0);
    assert_int_equal(js.members, 2);
    ts__msg_stream_ack_state as = ack(fd, "q", "g", "m2", 1, 4, 0);
    assert_int_equal(as.acked, 4);
    assert_int_equal(as.floor, 11);
    close(w);
    close(fd);
}

/* Two members waiting in READ: each append goes to exactly one, the longest waiting first. */
static void test_waiting_readers(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w1 = tsu_client(&srv), w2 = tsu_client(&srv);
    create(fd, "q", 100, 0, 0, 0, 0);
    join(fd, "q", "g", "m1", TS_STREAM_START_OLDEST, 200);
    join(fd, "q", "g", "m2", TS_STREAM_START_OLDEST, 0);
    uint32_t r2 = send_read(w2, "q", "g", "m2", 0, 10, 5000);
    wait_for_waits(fd, 1);
    uint32_t r1 = send_read(w1, "q", "g", "m1", 0, 10, 5000);
    wait_for_waits(fd, 2);
    append(fd, "q", 0);
    batch b;
    recv_entries(w2, TS_OP_STREAM_READ, r2, &b);
    expect_ids(&b, 1, 1);
    ack(fd, "q", "g", "m2", 1, 1, 0);
    append(fd, "q", 1);
    recv_entries(w1, TS_OP_STREAM_READ, r1, &b);
    expect_ids(&b, 2, 1);
    /* A member waiting in READ is live: its entries are not claimed however long it waits
     * (here twice the group's 200 ms lease). */
    r1 = send_read(w1, "q", "g", "m1", 0, 10, 5000);
    wait_for_waits(fd, 1);
    sleep_ms(400);
    read_b(fd, "q", "g", "m2", 0, 10, 0, &b);
    assert_int_equal(b.n, 0);
    assert_int_equal(info_int(fd, "q", "entries"), 2);
    append(fd, "q", 2);
    recv_entries(w1, TS_OP_STREAM_READ, r1, &b);
    expect_ids(&b, 3, 1);
    close(w2);
    close(w1);
    close(fd);
}

/* LEAVE: a member's entries go to the others at once (a waiting read is woken); the group. */
static void test_leave(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 0, 0);
    join(fd, "s", "g", "m1", TS_STREAM_START_OLDEST, 0);
    join(fd, "s", "g", "m2", TS_STREAM_START_OLDEST, 0);
    append(fd, "s", 0);
    append(fd, "s", 1);
    batch b;
    read_b(fd, "s", "g", "m1", 0, 10, 0, &b);
    expect_ids(&b, 1, 2);
    uint32_t id = send_read(w, "s", "g", "m2", 0, 10, 5000);
    wait_for_waits(fd, 1);
    leave(fd, "s", "g", "m1", TS_ST_OK);
    recv_entries(w, TS_OP_STREAM_READ, id, &b);
    expect_ids(&b, 1, 2);
    /* Gone: its reads are NOT_FOUND; leaving twice too. */
    id = send_read(fd, "s", "g", "m1", 0, 10, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_NOT_FOUND);
    leave(fd, "s", "g", "m1", TS_ST_NOT_FOUND);
    /* A member leaving while its read waits: that read is answered NOT_FOUND at once. The last
     * member leaving keeps the group (its cursor); an empty member removes it. */
    id = send_read(w, "s", "g", "m2", 2, 10, 5000);
    wait_for_waits(fd, 1);
    leave(fd, "s", "g", "m2", TS_ST_OK);
    expect_status(w, TS_OP_STREAM_READ, id, TS_ST_NOT_FOUND);
    assert_int_equal(tsu_stat(fd, "stream_waits"), 0);
    assert_int_equal(tsu_stat(fd, "stream_groups"), 1);
    ts__msg_stream_join_state js = join(fd, "s", "g", "m3", TS_STREAM_START_NEWEST, 0);
    assert_int_equal(js.next_id, 3);
    assert_int_equal(js.floor, 3);
    id = send_read(w, "s", "g", "m3", 0, 10, 5000);
    wait_for_waits(fd, 1);
    leave(fd, "s", "g", NULL, TS_ST_OK);
    expect_status(w, TS_OP_STREAM_READ, id, TS_ST_NOT_FOUND);
    join(fd, "s", "g", "m3", TS_STREAM_START_NEWEST, 0);
    leave(fd, "s", "g", NULL, TS_ST_OK);
    assert_int_equal(tsu_stat(fd, "stream_groups"), 0);
    leave(fd, "s", "g", NULL, TS_ST_NOT_FOUND);
    close(w);
    close(fd);
}

/* A partial ack's rows_done is shown on redelivery (and by JOIN); markers in the id sequence. */
static void test_partial_ack_and_markers(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 0, 0);
    append(fd, "s", 0);
    ts__msg_stream_append_state a = mark(fd, "s", 7, TS_ST_OK);
    assert_int_equal(a.id, 2);
    append(fd, "s", 2);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    batch b;
    read_b(fd, "s", "g", "m", 0, 10, 0, &b);
    assert_int_equal(b.n, 3);
    assert_int_equal(b.e[1].id, 2);
    assert_int_equal(b.e[1].kind, TS_STREAM_ENTRY_MARKER);
    assert_int_equal(b.e[1].tag, 7);
    assert_int_equal(b.e[1].len, 0);
    assert_int_equal(b.e[0].tag, 0);
    ts__msg_stream_ack_state as = ack(fd, "s", "g", "m", 1, 1, 5);
    assert_int_equal(as.acked, 0);
    assert_int_equal(as.pending, 3);
    ts__msg_stream_join_state js = join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    assert_int_equal(js.rows_done, 5);
    read_b(fd, "s", "g", "m", 0, 1, 0, &b);
    assert_int_equal(b.n, 1);
    assert_int_equal(b.e[0].id, 1);
    assert_int_equal(b.e[0].rows_done, 5);
    assert_int_equal(b.e[0].flags, TS_STREAM_ENTRY_REDELIVERED);
    close(fd);
}

/* WAIT and LISTEN on a stream; LIST shows it (small LIST). */
static void test_wait_listen_list(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), l = tsu_client(&srv);
    create(fd, "s", 100, 0, 0, 0, 0);
    append(fd, "s", 0);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_name(l, TS_OP_LISTEN, id, "s", NULL, 0), 0);
    tsu_frame f;
    expect(l, &f, TS_OP_LISTEN, id, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    tsu_frame_free(&f);
    assert_int_equal(v, 1);
    assert_int_equal(n, 1);
    /* WAIT above the last id: answered by the next append. */
    uint32_t wid = rid++;
    assert_int_equal(tsu_send_wait(l, wid, "s", 1, 5000), 0);
    append(fd, "s", 1);
    tsu_note note;
    int got_wait = 0, got_note = 0;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(tsu_recv(l, &f), 0);
        if (f.h.opcode == TS_OP_NOTIFY) {
            tsu_note_parse(&f, &note);
            assert_int_equal(note.event, TS_NOTE_APPEND);
            assert_int_equal(note.version, 2);
            assert_int_equal(note.n, 2);
            got_note = 1;
        } else {
            assert_int_equal(f.h.opcode, TS_OP_WAIT);
            assert_int_equal(f.h.request_id, wid);
            assert_int_equal(f.h.status, TS_ST_OK);
            tsu_state(&f, &v, &n);
            assert_int_equal(v, 2);
            got_wait = 1;
        }
        tsu_frame_free(&f);
    }
    assert_true(got_wait && got_note);
    /* Satisfied at once, and a marker notifies too. */
    wid = rid++;
    assert_int_equal(tsu_send_wait(l, wid, "s", 1, 0), 0);
    expect(l, &f, TS_OP_WAIT, wid, TS_ST_OK);
    tsu_frame_free(&f);
    mark(fd, "s", 1, TS_ST_OK);
    assert_int_equal(tsu_recv(l, &f), 0);
    tsu_note_parse(&f, &note);
    tsu_frame_free(&f);
    assert_int_equal(note.event, TS_NOTE_APPEND);
    assert_int_equal(note.version, 3);
    /* LIST: the stream beside a bin, sorted by name. */
    tsu_put_int(fd, TS_OP_PUT, "a", 1, &n);
    tsu_put_int(fd, TS_OP_PUT, "z", 1, &n);
    id = send_body(fd, TS_OP_LIST, NULL, 0);
    expect(fd, &f, TS_OP_LIST, id, TS_ST_OK);
    ts__msg_list lst;
    assert_int_equal(ts__msg_list_decode(f.body, f.len, &lst), 0);
    assert_int_equal(lst.n, 3);
    ts__msg_list_iter it = {0, 0};
    ts__msg_list_entry e;
    assert_int_equal(ts__msg_list_next(&lst, &it, &e), 1);
    assert_memory_equal(e.name, "a", 1);
    assert_int_equal(ts__msg_list_next(&lst, &it, &e), 1);
    assert_int_equal(e.name_len, 1);
    assert_memory_equal(e.name, "s", 1);
    assert_int_equal(e.n_items, 3);
    assert_int_equal(e.version, 3);
    assert_true(e.bytes > 0);
    tsu_frame_free(&f);
    /* DELETE: event 4, the state {last_id, entries removed}. */
    id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, id, "s", NULL, 0), 0);
    expect(fd, &f, TS_OP_DELETE, id, TS_ST_OK);
    tsu_state(&f, &v, &n);
    tsu_frame_free(&f);
    assert_int_equal(v, 3);
    assert_int_equal(n, 3);
    assert_int_equal(tsu_recv(l, &f), 0);
    tsu_note_parse(&f, &note);
    tsu_frame_free(&f);
    assert_int_equal(note.event, TS_NOTE_DELETE);
    assert_int_equal(tsu_stat(fd, "streams"), 0);
    close(l);
    close(fd);
}

/* LIST of more than TSD_LIST_OFFLOOP_MIN (4096) names: the off-loop path shows the stream. */
static void test_list_offloop(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    enum { NBINS = 4100 };
    size_t rlen;
    uint8_t *rec = tsu_rec_int(1, &rlen);
    /* Pipelined puts, bounded by the count; their replies are read after. */
    for (int i = 0; i < NBINS; i++) {
        char name[32];
        snprintf(name, sizeof(name), "b%05d", i);
        assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 100000u + (uint32_t)i, name, rec, rlen), 0);
        if (i % 256 == 255 || i == NBINS - 1) {
            for (int k = i - (i % 256); k <= i; k++) {
                tsu_frame f;
                expect(fd, &f, TS_OP_PUT, 100000u + (uint32_t)k, TS_ST_OK);
                tsu_frame_free(&f);
            }
        }
    }
    tsu_rec_free(rec, rlen);
    create(fd, "b02000x", 10, 0, 0, 0, 0);
    append(fd, "b02000x", 0);
    uint32_t id = send_body(fd, TS_OP_LIST, NULL, 0);
    tsu_frame f;
    expect(fd, &f, TS_OP_LIST, id, TS_ST_OK);
    ts__msg_list lst;
    assert_int_equal(ts__msg_list_decode(f.body, f.len, &lst), 0);
    assert_int_equal(lst.n, NBINS + 1);
    ts__msg_list_iter it = {0, 0};
    ts__msg_list_entry e;
    int seen = 0;
    for (uint32_t i = 0; i < lst.n; i++) {
        assert_int_equal(ts__msg_list_next(&lst, &it, &e), 1);
        if (e.name_len == 7 && memcmp(e.name, "b02000x", 7) == 0) {
            /* Sorted among the bins: right after b02000. */
            assert_int_equal(i, 2001);
            assert_int_equal(e.n_items, 1);
            assert_int_equal(e.version, 1);
            seen = 1;
        }
    }
    assert_true(seen);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "lists_offloop") >= 1);
    close(fd);
}

/* A plain bin's requests on a stream's name and STREAM_* on a bin's name: INVALID, both ways. */
static void test_name_clashes(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    create(fd, "s", 10, 0, 0, 0, 0);
    append(fd, "s", 0);
    uint32_t n;
    tsu_put_int(fd, TS_OP_PUT, "b", 1, &n);
    size_t rlen;
    uint8_t *rec = tsu_rec_int(5, &rlen);
    static const uint8_t ups[] = {TS_OP_PUT, TS_OP_APPEND, TS_OP_WRITE_ROWS, TS_OP_GATHER_ROWS};
    for (size_t i = 0; i < sizeof(ups); i++) {
        uint32_t id = rid++;
        assert_int_equal(tsu_send_store(fd, ups[i], id, "s", rec, rlen), 0);
        expect_status(fd, ups[i], id, TS_ST_INVALID);
    }
    static const uint8_t gets[] = {TS_OP_GET, TS_OP_PEEK};
    for (size_t i = 0; i < sizeof(gets); i++) {
        uint32_t id = rid++;
        assert_int_equal(tsu_send_get(fd, gets[i], id, "s", 0), 0);
        expect_status(fd, gets[i], id, TS_ST_INVALID);
    }
    uint64_t dims[1] = {4};
    ts__msg_tensor_bin_req tb = {
        .name = (const uint8_t *)"s", .name_len = 1, .dtype = TS_FLOAT32, .ndim = 1};
    memcpy(tb.dims, dims, sizeof(dims));
    uint8_t body[512];
    size_t len;
    assert_int_equal(ts__msg_tensor_bin_req_encode(body, sizeof(body), &tb, &len), 0);
    uint32_t id = send_body(fd, TS_OP_TENSOR_BIN, body, len);
    expect_status(fd, TS_OP_TENSOR_BIN, id, TS_ST_INVALID);
    /* The stream is untouched. */
    batch b;
    range_b(fd, "s", 0, 10, 0, &b);
    expect_ids(&b, 1, 1);
    /* The other way: a bin's name. */
    id = send_create(fd, "b", 10, 0, 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    id = send_append(fd, "b", 1);
    expect_status(fd, TS_OP_STREAM_APPEND, id, TS_ST_INVALID);
    id = send_read(fd, "b", "g", "m", 0, 1, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_INVALID);
    id = send_range(fd, "b", 0, 1, 0);
    expect_status(fd, TS_OP_STREAM_RANGE, id, TS_ST_INVALID);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "b", 0, &it);
    assert_int_equal(it.n, 1);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, rlen);
    ping(fd);
    close(fd);
}

/* Bad input is answered (NOT_FOUND, INVALID) and changes nothing; the connection stays. */
static void test_bad_input(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint32_t id = send_append(fd, "nope", 1);
    expect_status(fd, TS_OP_STREAM_APPEND, id, TS_ST_NOT_FOUND);
    /* Refused by its name: the body is dropped unchecked (no BAD_RECORD), the connection stays. */
    id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, "nope", "garbage", 7), 0);
    expect_status(fd, TS_OP_STREAM_APPEND, id, TS_ST_NOT_FOUND);
    ping(fd);
    id = send_credit(fd, "nope", 0);
    expect_status(fd, TS_OP_STREAM_CREDIT, id, TS_ST_NOT_FOUND);
    id = send_join(fd, "nope", "g", "m", 0, 0);
    expect_status(fd, TS_OP_STREAM_JOIN, id, TS_ST_NOT_FOUND);
    id = send_range(fd, "nope", 0, 1, 0);
    expect_status(fd, TS_OP_STREAM_RANGE, id, TS_ST_NOT_FOUND);
    assert_int_equal(tsu_stat(fd, "streams"), 0);

    id = send_create(fd, "s", 0, 0, 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    id = send_create(fd, "s", TS_STREAM_MAX_ENTRIES + 1, 0, 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    id = send_create(fd, "s", 10, 0, 0, 11, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    id = send_create(fd, "s", 10, 0, 0, 0, TS_STREAM_MAX_LEASE_MS + 1);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    assert_int_equal(tsu_stat(fd, "streams"), 0);

    create(fd, "s", 10, 0, 0, 5, 0);
    /* A window over max_entries when changing settings: refused, the old ones stay. */
    id = send_create(fd, "s", 4, 0, 0, 5, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_INVALID);
    assert_int_equal(info_int(fd, "s", "max_entries"), 10);
    for (int i = 0; i < 3; i++)
        append(fd, "s", i);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    batch b;
    read_b(fd, "s", "g", "m", 0, 2, 0, &b);
    expect_ids(&b, 1, 2);
    id = send_read(fd, "s", "g", "other", 0, 2, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_NOT_FOUND);
    /* Ids from the future: nothing is acknowledged, nothing handed out. */
    id = send_read(fd, "s", "g", "m", 4, 2, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_INVALID);
    id = send_ack(fd, "s", "g", "m", 1, 4, 0);
    expect_status(fd, TS_OP_STREAM_ACK, id, TS_ST_INVALID);
    id = send_ack(fd, "s", "g", "m", 2, 1, 0);
    expect_status(fd, TS_OP_STREAM_ACK, id, TS_ST_INVALID);
    id = send_ack(fd, "s", "g", "m", 1, 2, 3);
    expect_status(fd, TS_OP_STREAM_ACK, id, TS_ST_INVALID);
    id = send_read(fd, "s", "g", "m", 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_INVALID);
    id = send_read(fd, "s", "g", "m", 0, TS_STREAM_MAX_READ + 1, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_INVALID);
    id = send_range(fd, "s", 4, 1, 0);
    expect_status(fd, TS_OP_STREAM_RANGE, id, TS_ST_INVALID);
    id = send_range(fd, "s", 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_RANGE, id, TS_ST_INVALID);
    id = send_join(fd, "s", "g", "m", 2, 0);
    expect_status(fd, TS_OP_STREAM_JOIN, id, TS_ST_INVALID);
    id = send_join(fd, "s", "g2", "m", 0, TS_STREAM_MAX_LEASE_MS + 1);
    expect_status(fd, TS_OP_STREAM_JOIN, id, TS_ST_INVALID);
    assert_int_equal(tsu_stat(fd, "stream_groups"), 1);
    /* All as before: two pending, the third next. */
    ts__msg_stream_join_state js = join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    assert_int_equal(js.pending, 2);
    assert_int_equal(js.floor, 1);
    assert_int_equal(js.next_id, 3);
    ping(fd);
    close(fd);
}

/* DELETE answers a pending READ (and RANGE, CREDIT) NOT_FOUND. */
static void test_delete_with_pending_read(void **state)
{
    (void)state;
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "s", 10, 0, 0, 1, 0);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    uint32_t r1 = send_read(w, "s", "g", "m", 0, 10, 5000);
    uint32_t r2 = send_range(w, "s", 0, 10, 5000);
    append(fd, "s", 0);
    /* The read took entry 1; the range got it too. */
    batch b;
    tsu_frame f;
    for (int k = 0; k < 2; k++) {
        assert_int_equal(tsu_recv(w, &f), 0);
        assert_int_equal(f.h.status, TS_ST_OK);
        assert_true(f.h.request_id == r1 || f.h.request_id == r2);
        entries_of(&f, &b);
        expect_ids(&b, 1, 1);
        tsu_frame_free(&f);
    }
    r1 = send_read(w, "s", "g", "m", 0, 10, 5000);
    r2 = send_credit(w, "s", 5000);
    wait_for_waits(fd, 2);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, id, "s", NULL, 0), 0);
    expect(fd, &f, TS_OP_DELETE, id, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    tsu_frame_free(&f);
    assert_int_equal(v, 1);
    assert_int_equal(n, 1);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(tsu_recv(w, &f), 0);
        assert_int_equal(f.h.status, TS_ST_NOT_FOUND);
        assert_true(f.h.request_id == r1 || f.h.request_id == r2);
        tsu_frame_free(&f);
    }
    assert_int_equal(tsu_stat(fd, "stream_waits"), 0);
    ping(w);
    close(w);
    close(fd);
}

/* --max-watch counts pending stream waits; a stop answers them SHUTTING_DOWN. */
static void test_max_watch_and_shutdown(void **state)
{
    (void)state;
    tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    const char *args[] = {"--max-watch", "2", NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv), w = tsu_client(&srv);
    create(fd, "s", 10, 0, 0, 0, 0);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    uint32_t r1 = send_read(w, "s", "g", "m", 0, 10, 10000);
    uint32_t r2 = send_range(w, "s", 0, 10, 10000);
    uint32_t r3 = send_range(w, "s", 0, 10, 10000);
    expect_status(w, TS_OP_STREAM_RANGE, r3, TS_ST_INVALID);
    /* The stop answers both waits, then says so on the connection. */
    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    int got = 0;
    for (int k = 0; k < 3; k++) {
        tsu_frame f;
        assert_int_equal(tsu_recv(w, &f), 0);
        assert_int_equal(f.h.status, TS_ST_SHUTTING_DOWN);
        if (f.h.request_id == r1 || f.h.request_id == r2)
            got++;
        tsu_frame_free(&f);
    }
    assert_int_equal(got, 2);
    close(w);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    srv.pid = 0;
}

/* Records, rings, groups, members and pending entries count, and all of it goes with DELETE. */
static void test_memory_accounting(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int64_t o0 = tsu_stat(fd, "overhead_bytes"), b0 = tsu_stat(fd, "bytes");
    create(fd, "s", 1000, 0, 0, 0, 0);
    join(fd, "s", "g", "m1", TS_STREAM_START_OLDEST, 0);
    join(fd, "s", "g", "m2", TS_STREAM_START_OLDEST, 0);
    join(fd, "s", "h", "m", TS_STREAM_START_OLDEST, 0);
    for (int i = 0; i < 100; i++)
        append(fd, "s", i);
    mark(fd, "s", 1, TS_ST_OK);
    batch b;
    read_b(fd, "s", "g", "m1", 0, 50, 0, &b);
    read_b(fd, "s", "g", "m2", 0, 50, 0, &b);
    read_b(fd, "s", "h", "m", 0, 30, 0, &b);
    leave(fd, "s", "g", "m1", TS_ST_OK);
    assert_true(tsu_stat(fd, "overhead_bytes") > o0);
    assert_true(tsu_stat(fd, "bytes") > b0);
    assert_int_equal(tsu_stat(fd, "stream_bytes"), tsu_stat(fd, "bytes") - b0);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, id, "s", NULL, 0), 0);
    expect_status(fd, TS_OP_DELETE, id, TS_ST_OK);
    assert_int_equal(tsu_stat(fd, "overhead_bytes"), o0);
    assert_int_equal(tsu_stat(fd, "bytes"), b0);
    assert_int_equal(tsu_stat(fd, "stream_bytes"), 0);
    close(fd);
}

/* --max-memory refuses appends past it; retention gives the bytes back. */
static void test_max_memory(void **state)
{
    (void)state;
    tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    const char *args[] = {"--max-memory", "2000000", NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv);
    size_t rlen;
    uint8_t *rec = tsu_rec_bytes(100000, 3, &rlen);
    /* A stream keeping two entries takes any number of appends. */
    create(fd, "keep2", 2, 0, 0, 0, 0);
    for (int i = 0; i < 40; i++) {
        uint32_t id = rid++;
        assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, "keep2", rec, rlen), 0);
        expect_status(fd, TS_OP_STREAM_APPEND, id, TS_ST_OK);
    }
    /* One keeping everything runs into the limit (within 20 records of 100 kB). */
    create(fd, "all", 1000, 0, 0, 0, 0);
    int ok = 0, refused = 0;
    for (int i = 0; i < 20 && !refused; i++) {
        uint32_t id = rid++;
        assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, "all", rec, rlen), 0);
        tsu_frame f;
        assert_int_equal(tsu_recv(fd, &f), 0);
        assert_int_equal(f.h.request_id, id);
        if (f.h.status == TS_ST_OK)
            ok++;
        else
            refused = f.h.status == TS_ST_OUT_OF_MEMORY;
        tsu_frame_free(&f);
    }
    assert_true(ok >= 3);
    assert_true(refused);
    assert_int_equal(info_int(fd, "all", "entries"), ok);
    /* Fewer kept: room again. */
    create(fd, "all", 1, 0, 0, 0, 0);
    uint32_t id = rid++;
    assert_int_equal(tsu_send_store(fd, TS_OP_STREAM_APPEND, id, "all", rec, rlen), 0);
    expect_status(fd, TS_OP_STREAM_APPEND, id, TS_ST_OK);
    tsu_rec_free(rec, rlen);
    close(fd);
}

/* While snapshots fail (--stop-writes-on-save-error), stream writes are refused; reads go on. */
static void test_save_failing(void **state)
{
    (void)state;
    tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    char dir[] = "/tmp/tsstream.XXXXXX";
    assert_non_null(mkdtemp(dir));
    char sub[64], gone[64], snap[80];
    snprintf(sub, sizeof(sub), "%s/d", dir);
    snprintf(gone, sizeof(gone), "%s/gone", dir);
    snprintf(snap, sizeof(snap), "%s/snap", sub);
    assert_int_equal(mkdir(sub, 0700), 0);
    const char *args[] = {"--save", snap, "--stop-writes-on-save-error", "yes", NULL};
    assert_int_equal(tsh_server_start(&srv, args), 0);
    int fd = tsu_client(&srv);
    create(fd, "s", 10, 0, 0, 0, 0);
    append(fd, "s", 0);
    join(fd, "s", "g", "m", TS_STREAM_START_OLDEST, 0);
    /* Every snapshot fails: the directory moves away and a plain file takes its name. */
    assert_int_equal(rename(sub, gone), 0);
    FILE *x = fopen(sub, "w");
    assert_non_null(x);
    fclose(x);
    uint32_t id = send_body(fd, TS_OP_SAVE, NULL, 0);
    expect_status(fd, TS_OP_SAVE, id, TS_ST_INTERNAL);
    id = send_create(fd, "t", 10, 0, 0, 0, 0);
    expect_status(fd, TS_OP_STREAM_CREATE, id, TS_ST_SAVE_FAILING);
    append_st(fd, "s", 1, TS_ST_SAVE_FAILING);
    mark(fd, "s", 1, TS_ST_SAVE_FAILING);
    id = send_join(fd, "s", "g", "m", 0, 0);
    expect_status(fd, TS_OP_STREAM_JOIN, id, TS_ST_SAVE_FAILING);
    id = send_read(fd, "s", "g", "m", 0, 1, 0);
    expect_status(fd, TS_OP_STREAM_READ, id, TS_ST_SAVE_FAILING);
    id = send_ack(fd, "s", "g", "m", 1, 1, 0);
    expect_status(fd, TS_OP_STREAM_ACK, id, TS_ST_SAVE_FAILING);
    leave(fd, "s", "g", "m", TS_ST_SAVE_FAILING);
    id = rid++;
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, id, "s", NULL, 0), 0);
    expect_status(fd, TS_OP_DELETE, id, TS_ST_SAVE_FAILING);
    /* Reads go on, and nothing changed. */
    batch b;
    range_b(fd, "s", 0, 10, 0, &b);
    expect_ids(&b, 1, 1);
    id = send_credit(fd, "s", 0);
    expect_status(fd, TS_OP_STREAM_CREDIT, id, TS_ST_OK);
    assert_int_equal(info_int(fd, "s", "last_id"), 1);
    /* Mended: the next snapshot succeeds and writes go on. */
    assert_int_equal(unlink(sub), 0);
    assert_int_equal(rename(gone, sub), 0);
    id = send_body(fd, TS_OP_SAVE, NULL, 0);
    expect_status(fd, TS_OP_SAVE, id, TS_ST_OK);
    append(fd, "s", 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&srv), 0);
    char p[128];
    snprintf(p, sizeof(p), "%s.lock", snap);
    unlink(p);
    unlink(snap);
    rmdir(sub);
    rmdir(dir);
}

/* A fixed pseudo-random walk over every stream request; the group invariants hold throughout. */
static uint32_t lcg_state = 12345u;
static uint32_t lcg(uint32_t n)
{
    lcg_state = lcg_state * 1103515245u + 12345u;
    return (lcg_state >> 8) % n;
}

static void check_invariants(int fd, const char *name)
{
    ts_value_t *root = info(fd, name);
    int64_t first, last, entries;
    assert_int_equal(ts_map_get_int(root, "first_id", &first), 0);
    assert_int_equal(ts_map_get_int(root, "last_id", &last), 0);
    assert_int_equal(ts_map_get_int(root, "entries", &entries), 0);
    assert_int_equal(entries, last + 1 - first);
    const ts_value_t *groups = ts_map_get(root, "groups");
    assert_non_null(groups);
    for (size_t i = 0; i < ts_value_len(groups); i++) {
        const ts_value_t *g = ts_list_at(groups, i);
        int64_t next, floor, lag, pending;
        assert_int_equal(ts_map_get_int(g, "next_id", &next), 0);
        assert_int_equal(ts_map_get_int(g, "floor", &floor), 0);
        assert_int_equal(ts_map_get_int(g, "lag", &lag), 0);
        assert_int_equal(ts_map_get_int(g, "pending", &pending), 0);
        assert_true(first <= floor && floor <= next && next <= last + 1);
        assert_int_equal(lag, last + 1 - floor);
        assert_true(pending <= next - floor);
        const ts_value_t *members = ts_map_get(g, "members");
        int64_t sum = 0;
        for (size_t k = 0; k < ts_value_len(members); k++) {
            int64_t mp;
            assert_int_equal(ts_map_get_int(ts_list_at(members, k), "pending", &mp), 0);
            sum += mp;
        }
        assert_true(sum <= pending);
    }
    ts__record_tree_free(root);
}

static void test_random_walk(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    static const char *groups[] = {"g1", "g2"};
    static const char *members[] = {"a", "b", "c"};
    create(fd, "r", 20, 0, 0, 8, 100);
    for (int op = 0; op < 1500; op++) {
        const char *g = groups[lcg(2)], *m = members[lcg(3)];
        uint32_t id, k = lcg(100);
        if (k < 30) {
            id = send_append(fd, "r", op);
            tsu_frame f;
            assert_int_equal(tsu_recv(fd, &f), 0);
            assert_int_equal(f.h.request_id, id);
            assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_BACKPRESSURE);
            tsu_frame_free(&f);
        } else if (k < 35) {
            mark(fd, "r", (uint64_t)op, TS_ST_OK);
        } else if (k < 50) {
            join(fd, "r", g, m, (uint8_t)lcg(2), lcg(3) == 0 ? 50 + lcg(100) : 0);
        } else if (k < 70) {
            id = send_read(fd, "r", g, m, lcg(4) == 0 ? lcg(40) : 0, 1 + lcg(6), 0);
            tsu_frame f;
            assert_int_equal(tsu_recv(fd, &f), 0);
            assert_int_equal(f.h.request_id, id);
            assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_NOT_FOUND ||
                        f.h.status == TS_ST_INVALID);
            if (f.h.status == TS_ST_OK) {
                batch b;
                entries_of(&f, &b);
            }
            tsu_frame_free(&f);
        } else if (k < 85) {
            uint64_t first = 1 + lcg(40), last = first + lcg(5);
            id = send_ack(fd, "r", g, m, first, last, lcg(5) == 0 ? 1 + lcg(3) : 0);
            tsu_frame f;
            assert_int_equal(tsu_recv(fd, &f), 0);
            assert_int_equal(f.h.request_id, id);
            assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_NOT_FOUND ||
                        f.h.status == TS_ST_INVALID);
            tsu_frame_free(&f);
        } else if (k < 90) {
            ts__msg_stream_member_req q = member_req("r", g, lcg(4) == 0 ? NULL : m);
            uint8_t body[1024];
            size_t len;
            assert_int_equal(ts__msg_stream_leave_req_encode(body, sizeof(body), &q, &len), 0);
            id = send_body(fd, TS_OP_STREAM_LEAVE, body, len);
            tsu_frame f;
            assert_int_equal(tsu_recv(fd, &f), 0);
            assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_NOT_FOUND);
            tsu_frame_free(&f);
        } else if (k < 94) {
            uint64_t max = 5 + lcg(30);
            create(fd, "r", max, lcg(2) ? 0 : 2000, 0, (uint32_t)lcg((uint32_t)max + 1), 100);
        } else if (k < 97) {
            batch b;
            range_b(fd, "r", lcg(2) ? 0 : 5, 1 + lcg(10), 0, &b);
        } else {
            sleep_ms(lcg(60));
        }
        if (op % 50 == 0)
            check_invariants(fd, "r");
    }
    check_invariants(fd, "r");
    /* The walk went through back-pressure and retention past unacknowledged entries. */
    assert_true(tsu_stat(fd, "stream_backpressure") > 0);
    assert_true(tsu_stat(fd, "stream_entries_lost") > 0);
    tsu_check_healthy(&srv);
    close(fd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_dense_ids_and_range, start, stop),
        cmocka_unit_test_setup_teardown(test_retention, start, stop),
        cmocka_unit_test_setup_teardown(test_range_blocking, start, stop),
        cmocka_unit_test_setup_teardown(test_fan_out, start, stop),
        cmocka_unit_test_setup_teardown(test_newest_and_rejoin, start, stop),
        cmocka_unit_test_setup_teardown(test_credits, start, stop),
        cmocka_unit_test_setup_teardown(test_work_queue, start, stop),
        cmocka_unit_test_setup_teardown(test_waiting_readers, start, stop),
        cmocka_unit_test_setup_teardown(test_leave, start, stop),
        cmocka_unit_test_setup_teardown(test_partial_ack_and_markers, start, stop),
        cmocka_unit_test_setup_teardown(test_wait_listen_list, start, stop),
        cmocka_unit_test_setup_teardown(test_list_offloop, start, stop),
        cmocka_unit_test_setup_teardown(test_name_clashes, start, stop),
        cmocka_unit_test_setup_teardown(test_bad_input, start, stop),
        cmocka_unit_test_setup_teardown(test_delete_with_pending_read, start, stop),
        cmocka_unit_test_setup_teardown(test_max_watch_and_shutdown, start, stop),
        cmocka_unit_test_setup_teardown(test_memory_accounting, start, stop),
        cmocka_unit_test_setup_teardown(test_max_memory, start, stop),
        cmocka_unit_test_setup_teardown(test_save_failing, start, stop),
        cmocka_unit_test_setup_teardown(test_random_walk, start, stop),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
