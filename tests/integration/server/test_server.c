/*
 * tensord over raw sockets: every operation and its reply layout, the original's semantics case
 * by case, notifications, WAIT, pipelining, the unix socket and lz4 bodies.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "compress.h"
#include "msg.h"
#include "test_server_util.h"

static tsh_server srv;

static int start(void **state)
{
    (void)state;
    return tsh_server_start(&srv, NULL);
}

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    /* tensord must exit 0 (clean, and leak-free under ASan) after every test. */
    return rc == 0 ? 0 : -1;
}

static uint64_t now_ms(void)
{
    return ts__now_ns() / 1000000u;
}

static void test_hello(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    uint8_t body[8] = {1, TS_HELLO_LZ4, 4, 0, 's', 'e', 'c', 'r'};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 77, body, sizeof(body)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 77, TS_ST_OK);
    assert_int_equal(f.len, 24);
    assert_int_equal(f.body[0], 1);
    assert_int_equal(f.body[1], TS_HELLO_LZ4);
    assert_int_equal(ts__get_u16le(f.body + 2), 0);
    assert_int_equal(ts__get_u32le(f.body + 4), 0);
    assert_int_equal(ts__get_u64le(f.body + 8), TS_DEFAULT_MAX_FRAME);
    uint64_t id = ts__get_u64le(f.body + 16);
    tsu_frame_free(&f);
    close(fd);

    /* Without the flag the server does not offer lz4; the server id stays the same. */
    fd = tsh_connect_tcp(srv.port);
    uint8_t plain[4] = {3, 0, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, plain, sizeof(plain)), 0);
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_int_equal(f.body[0], 1);
    assert_int_equal(f.body[1], 0);
    assert_int_equal(ts__get_u64le(f.body + 16), id);
    tsu_frame_free(&f);
    close(fd);

    /* A client that only speaks version 0 is refused and disconnected. */
    fd = tsh_connect_tcp(srv.port);
    uint8_t old[4] = {0, 0, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 2, old, sizeof(old)), 0);
    tsu_expect_error_close(fd, TS_ST_UNSUPPORTED_VERSION);
    close(fd);
}

static void test_ping_and_save(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_PING, 5, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, 5, TS_ST_OK);
    assert_int_equal(f.len, 0);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 6, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_SAVE, 6, TS_ST_INVALID);
    assert_int_equal(f.len, strlen("snapshots not configured"));
    assert_memory_equal(f.body, "snapshots not configured", f.len);
    tsu_frame_free(&f);
    /* SAVE's refusal keeps the connection. */
    assert_int_equal(tsh_send(fd, TS_OP_PING, 7, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, 7, TS_ST_OK);
    close(fd);
}

static void test_put_replaces(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint32_t n;
    uint64_t v1 = tsu_put_int(fd, TS_OP_PUT, "params", 1, &n);
    assert_int_equal(n, 1);
    uint64_t v2 = tsu_put_int(fd, TS_OP_PUT, "params", 2, &n);
    assert_int_equal(n, 1);
    assert_true(v2 > v1);
    /* Versions start at the wall clock in microseconds (after 2020). */
    assert_true(v1 > (uint64_t)1577836800 * 1000000u);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "params", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.remaining, 1);
    assert_int_equal(it.version, v2);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 2);
    tsu_frame_free(&it.f);
    /* A put over an appended bin replaces every item. */
    tsu_put_int(fd, TS_OP_APPEND, "params", 3, &n);
    assert_int_equal(n, 2);
    tsu_put_int(fd, TS_OP_PUT, "params", 4, &n);
    assert_int_equal(n, 1);
    close(fd);
}

static void test_append_creates_and_extends(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint32_t n;
    uint64_t prev = 0;
    for (int i = 0; i < 5; i++) {
        uint64_t v = tsu_put_int(fd, TS_OP_APPEND, "data", 100 + i, &n);
        assert_int_equal(n, (uint32_t)i + 1);
        assert_true(v > prev);
        prev = v;
    }
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "data", 0, &it);
    assert_int_equal(it.n, 5);
    assert_int_equal(it.version, prev);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(tsu_item_int(it.item[i], it.item_len[i]), 100 + i);
    tsu_frame_free(&it.f);
    close(fd);
}

static void test_get_removes(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint64_t v = tsu_put_int(fd, TS_OP_APPEND, "q", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "q", 2, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_GET, "q", 0, &it);
    assert_int_equal(it.n, 2);
    assert_int_equal(it.remaining, 0);
    assert_true(it.version > v);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 1);
    assert_int_equal(tsu_item_int(it.item[1], it.item_len[1]), 2);
    tsu_frame_free(&it.f);

    /* The bin is gone: get and peek of a missing bin are NOT_FOUND, naming it. */
    tsu_frame f;
    for (uint8_t op = TS_OP_GET; op <= TS_OP_PEEK; op++) {
        assert_int_equal(tsu_send_get(fd, op, 9, "q", 0), 0);
        tsu_expect(fd, &f, op, 9, TS_ST_NOT_FOUND);
        assert_int_equal(f.len, strlen("no such bin: q"));
        assert_memory_equal(f.body, "no such bin: q", f.len);
        tsu_frame_free(&f);
    }
    assert_int_equal(tsh_send(fd, TS_OP_LIST, 10, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LIST, 10, TS_ST_OK);
    assert_int_equal(f.len, 8);
    assert_int_equal(ts__get_u32le(f.body), 0);
    tsu_frame_free(&f);
    close(fd);
}

static void test_get_max_items(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    for (int i = 0; i < 5; i++)
        tsu_put_int(fd, TS_OP_APPEND, "batch", i, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_GET, "batch", 2, &it);
    assert_int_equal(it.n, 2);
    assert_int_equal(it.remaining, 3);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 0);
    assert_int_equal(tsu_item_int(it.item[1], it.item_len[1]), 1);
    uint64_t vget = it.version;
    tsu_frame_free(&it.f);

    /* The bin's version is that of the get; peek with a limit removes nothing. */
    tsu_get(fd, TS_OP_PEEK, "batch", 1, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.remaining, 3);
    assert_int_equal(it.version, vget);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 2);
    tsu_frame_free(&it.f);

    /* More than there are gives what there is. */
    tsu_get(fd, TS_OP_GET, "batch", 100, &it);
    assert_int_equal(it.n, 3);
    assert_int_equal(it.remaining, 0);
    assert_int_equal(tsu_item_int(it.item[2], it.item_len[2]), 4);
    tsu_frame_free(&it.f);
    close(fd);
}

static void test_delete(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    tsu_frame f;
    uint64_t v;
    uint32_t n;
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 1, "gone", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    tsu_frame_free(&f);

    /* Deleting a missing bin: OK, n = 0, and no notification (the next frame is the ping). */
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 2, "gone", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_DELETE, 2, TS_ST_OK);
    tsu_state(&f, &v, &n);
    assert_int_equal(v, 0);
    assert_int_equal(n, 0);
    tsu_frame_free(&f);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 3, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, 3, TS_ST_OK);

    tsu_put_int(fd, TS_OP_APPEND, "gone", 1, NULL);
    tsu_expect(fd, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
    tsu_frame_free(&f);
    uint64_t va = tsu_put_int(fd, TS_OP_APPEND, "gone", 2, NULL);
    tsu_expect(fd, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 4, "gone", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_DELETE, 4, TS_ST_OK);
    tsu_state(&f, &v, &n);
    assert_true(v > va);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
    tsu_note note;
    tsu_note_parse(&f, &note);
    assert_int_equal(note.event, TS_NOTE_DELETE);
    assert_int_equal(note.n, 0);
    assert_int_equal(note.version, v);
    assert_string_equal(note.name, "gone");
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 5, "gone", 0), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, 5, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    close(fd);
}

static void test_list_sorted(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    const char *names[] = {"b", "a b", "", "a", "ab"};
    uint64_t vers[5];
    for (int i = 0; i < 5; i++) {
        vers[i] = tsu_put_int(fd, TS_OP_APPEND, names[i], i, NULL);
        if (i == 1)
            vers[i] = tsu_put_int(fd, TS_OP_APPEND, names[i], i, NULL);
    }
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_LIST, 3, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LIST, 3, TS_ST_OK);
    ts__rd r;
    ts__rd_init(&r, f.body, f.len);
    uint32_t count = 0, zero = 1;
    ts__rd_u32(&r, &count);
    ts__rd_u32(&r, &zero);
    assert_int_equal(count, 5);
    assert_int_equal(zero, 0);
    /* Sorted by name bytes: "", "a", "a b", "ab", "b". */
    const int order[] = {2, 3, 1, 4, 0};
    for (int i = 0; i < 5; i++) {
        const char *name;
        size_t nl;
        uint32_t n;
        uint64_t bytes, ver;
        assert_int_equal(ts__rd_name(&r, &name, &nl), 0);
        ts__rd_u32(&r, &n);
        ts__rd_u64(&r, &bytes);
        assert_int_equal(ts__rd_u64(&r, &ver), 0);
        const char *want = names[order[i]];
        assert_int_equal(nl, strlen(want));
        assert_memory_equal(name, want, nl);
        assert_int_equal(n, order[i] == 1 ? 2 : 1);
        size_t rl;
        uint8_t *rec = tsu_rec_int(0, &rl);
        tsu_rec_free(rec, rl);
        assert_int_equal(bytes, (uint64_t)rl * n);
        assert_int_equal(ver, vers[order[i]]);
    }
    assert_int_equal(r.left, 0);
    tsu_frame_free(&f);
    close(fd);
}

#define N_LIST_BINS 5000

/*
 * A LIST of many bins is sorted and encoded on the thread pool: the reply is the same (every
 * bin, sorted by name bytes, its count, bytes and version), requests behind it are answered, and
 * a connection that closes before its LIST is ready costs nothing.
 */
static void test_list_large(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_int(3, &len);
    char name[32];
    /* Names in an order unrelated to their sort order; every fifth bin holds two items. */
    for (uint32_t i = 0; i < N_LIST_BINS; i++) {
        uint32_t k = (i * 7919u) % N_LIST_BINS;
        snprintf(name, sizeof(name), "L%u", k);
        assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 1, name, rec, len), 0);
        if (k % 5 == 0)
            assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 1, name, rec, len), 0);
    }
    tsu_frame f;
    for (uint32_t i = 0; i < N_LIST_BINS + N_LIST_BINS / 5; i++) {
        tsu_expect(fd, &f, TS_OP_APPEND, 1, TS_ST_OK);
        tsu_frame_free(&f);
    }
    /* One closes before its LIST is answered. */
    int gone = tsu_client(&srv);
    assert_int_equal(tsh_send(gone, TS_OP_LIST, 2, NULL, 0), 0);
    close(gone);
    assert_int_equal(tsh_send(fd, TS_OP_LIST, 3, NULL, 0), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 4, NULL, 0), 0);
    tsu_frame list = {0};
    int got_ping = 0;
    for (int i = 0; i < 2; i++) {
        assert_int_equal(tsu_recv(fd, &f), 0);
        assert_int_equal(f.h.status, TS_ST_OK);
        if (f.h.opcode == TS_OP_PING) {
            got_ping++;
            tsu_frame_free(&f);
        } else {
            assert_int_equal(f.h.opcode, TS_OP_LIST);
            assert_int_equal(f.h.request_id, 3);
            list = f;
        }
    }
    assert_int_equal(got_ping, 1);
    ts__rd r;
    ts__rd_init(&r, list.body, list.len);
    uint32_t count = 0, zero = 1;
    ts__rd_u32(&r, &count);
    ts__rd_u32(&r, &zero);
    assert_int_equal(count, N_LIST_BINS);
    assert_int_equal(zero, 0);
    const uint8_t *prev = NULL;
    size_t prev_len = 0;
    for (uint32_t i = 0; i < count; i++) {
        const char *nm;
        size_t nl;
        uint32_t n;
        uint64_t bytes, ver;
        ts__rd_name(&r, &nm, &nl);
        ts__rd_u32(&r, &n);
        ts__rd_u64(&r, &bytes);
        ts__rd_u64(&r, &ver);
        assert_int_equal(r.err, 0);
        if (prev != NULL) {
            size_t m = prev_len < nl ? prev_len : nl;
            int c = memcmp(prev, nm, m);
            assert_true(c < 0 || (c == 0 && prev_len < nl));
        }
        prev = (const uint8_t *)nm;
        prev_len = nl;
        assert_true(nl >= 2 && nm[0] == 'L');
        uint32_t k = (uint32_t)strtoul(nm + 1, NULL, 10);
        assert_int_equal(n, k % 5 == 0 ? 2 : 1);
        assert_int_equal(bytes, (uint64_t)n * len);
        assert_true(ver > 0);
    }
    assert_int_equal(r.left, 0);
    tsu_frame_free(&list);
    assert_true(tsu_stat(fd, "lists_offloop") >= 1);
    tsu_rec_free(rec, len);
    close(fd);
    tsu_check_healthy(&srv);
}

/*
 * A LIST of many bins keeps its place among the connection's replies: requests pipelined behind
 * it (here a PING, a DELETE of a listed bin and another PING, all sent at once with the LIST) are
 * answered after it, in order, and the DELETE takes effect after the LIST's snapshot.
 */
static void test_list_large_in_order(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_int(5, &len);
    char name[32];
    for (uint32_t i = 0; i < N_LIST_BINS; i++) {
        snprintf(name, sizeof(name), "O%u", i);
        assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 1, name, rec, len), 0);
    }
    tsu_frame f;
    for (uint32_t i = 0; i < N_LIST_BINS; i++) {
        tsu_expect(fd, &f, TS_OP_PUT, 1, TS_ST_OK);
        tsu_frame_free(&f);
    }
    /* The four requests in one write, so they arrive together behind the LIST. */
    uint8_t buf[4 * TS_HDR_SIZE + 16];
    size_t off = 0;
    const uint8_t ops[4] = {TS_OP_LIST, TS_OP_PING, TS_OP_DELETE, TS_OP_PING};
    for (uint32_t i = 0; i < 4; i++) {
        size_t blen = 0;
        uint8_t body[8];
        if (ops[i] == TS_OP_DELETE) {
            ts__msg_name_req q = {.name = (const uint8_t *)"O7", .name_len = 2};
            assert_int_equal(ts__msg_name_req_encode(body, sizeof(body), &q, &blen), 0);
        }
        ts__hdr h = {.magic = TS_MAGIC_REQ,
                     .version = TS_PROTO_VERSION,
                     .opcode = ops[i],
                     .request_id = 10 + i,
                     .body_len = blen};
        ts__hdr_encode(&h, buf + off);
        memcpy(buf + off + TS_HDR_SIZE, body, blen);
        off += TS_HDR_SIZE + blen;
    }
    assert_int_equal(tsh_write_all(fd, buf, off), 0);
    tsu_expect(fd, &f, TS_OP_LIST, 10, TS_ST_OK);
    ts__msg_list l;
    assert_int_equal(ts__msg_list_decode(f.body, f.len, &l), 0);
    assert_int_equal(l.n, N_LIST_BINS); /* O7 is still listed: the DELETE came after */
    tsu_frame_free(&f);
    tsu_expect(fd, &f, TS_OP_PING, 11, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, TS_OP_DELETE, 12, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_expect(fd, &f, TS_OP_PING, 13, TS_ST_OK);
    tsu_frame_free(&f);
    assert_true(tsu_stat(fd, "lists_offloop") >= 1);
    tsu_rec_free(rec, len);
    tsu_check_healthy(&srv);
    /*
     * One more LIST left unread: the teardown stops the daemon, most likely while it is still
     * being sorted and its connection held, and the daemon must still exit cleanly.
     */
    assert_int_equal(tsh_send(fd, TS_OP_LIST, 20, NULL, 0), 0);
    close(fd);
}

static void test_names_with_spaces_and_empty(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    const char *names[] = {"with space", "", " leading", "a/b", "\xc3\xbc"};
    for (int i = 0; i < 5; i++)
        tsu_put_int(fd, TS_OP_PUT, names[i], 10 + i, NULL);
    for (int i = 0; i < 5; i++) {
        tsu_items it;
        tsu_get(fd, TS_OP_GET, names[i], 0, &it);
        assert_int_equal(it.n, 1);
        assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 10 + i);
        tsu_frame_free(&it.f);
    }
    /* A 255-byte name, the longest the wire can carry. */
    char longname[256];
    memset(longname, 'x', 255);
    longname[255] = '\0';
    tsu_put_int(fd, TS_OP_PUT, longname, 1, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, longname, 0, &it);
    assert_int_equal(it.n, 1);
    tsu_frame_free(&it.f);
    close(fd);
}

static void test_notifications(void **state)
{
    (void)state;
    int w = tsu_client(&srv);
    int l = tsu_client(&srv);
    tsu_frame f;
    uint64_t v;
    uint32_t n;
    for (int i = 0; i < 2; i++) {
        /* Listening twice is idempotent: one notification per change, not two. */
        for (int k = 0; k < 2; k++) {
            int fd = i == 0 ? w : l;
            assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 20 + k, "p", NULL, 0), 0);
            tsu_expect(fd, &f, TS_OP_LISTEN, 20 + k, TS_ST_OK);
            tsu_state(&f, &v, &n);
            assert_int_equal(v, 0);
            assert_int_equal(n, 0);
            tsu_frame_free(&f);
        }
    }
    struct {
        uint8_t op;
        uint8_t event;
        uint32_t n;
    } steps[] = {
        {TS_OP_PUT, TS_NOTE_PUT, 1},       {TS_OP_APPEND, TS_NOTE_APPEND, 2},
        {TS_OP_APPEND, TS_NOTE_APPEND, 3}, {TS_OP_PEEK, 0, 0},
        {TS_OP_GET, TS_NOTE_GET, 0},       {TS_OP_PUT, TS_NOTE_PUT, 1},
        {TS_OP_DELETE, TS_NOTE_DELETE, 0},
    };
    uint64_t last = 0;
    for (size_t s = 0; s < TS__ARRAY_SIZE(steps); s++) {
        uint32_t rid = 100 + (uint32_t)s;
        uint64_t ver = 0;
        if (steps[s].op == TS_OP_PUT || steps[s].op == TS_OP_APPEND) {
            size_t len;
            uint8_t *rec = tsu_rec_int((int64_t)s, &len);
            assert_int_equal(tsu_send_store(w, steps[s].op, rid, "p", rec, len), 0);
            tsu_rec_free(rec, len);
            /* The writer's own reply comes first, then its notification. */
            tsu_expect(w, &f, steps[s].op, rid, TS_ST_OK);
            tsu_state(&f, &ver, &n);
        } else if (steps[s].op == TS_OP_DELETE) {
            assert_int_equal(tsu_send_name(w, TS_OP_DELETE, rid, "p", NULL, 0), 0);
            tsu_expect(w, &f, TS_OP_DELETE, rid, TS_ST_OK);
            tsu_state(&f, &ver, &n);
        } else {
            assert_int_equal(tsu_send_get(w, steps[s].op, rid, "p", 0), 0);
            tsu_expect(w, &f, steps[s].op, rid, TS_ST_OK);
            ver = ts__get_u64le(f.body);
        }
        tsu_frame_free(&f);
        if (steps[s].event == 0) {
            /* peek: no notification; the ping reply is the next frame on both. */
            for (int i = 0; i < 2; i++) {
                int fd = i == 0 ? w : l;
                assert_int_equal(tsh_send(fd, TS_OP_PING, rid, NULL, 0), 0);
                tsu_expect(fd, &f, TS_OP_PING, rid, TS_ST_OK);
            }
            continue;
        }
        assert_true(ver > last);
        last = ver;
        for (int i = 0; i < 2; i++) {
            int fd = i == 0 ? w : l;
            tsu_expect(fd, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
            tsu_note note;
            tsu_note_parse(&f, &note);
            assert_int_equal(note.event, steps[s].event);
            assert_int_equal(note.n, steps[s].n);
            assert_int_equal(note.version, ver);
            assert_int_equal(note.flags, 0);
            assert_string_equal(note.name, "p");
            tsu_frame_free(&f);
        }
    }
    /* After unlisten, l hears nothing more; a second unlisten is NOT_FOUND. */
    assert_int_equal(tsu_send_name(l, TS_OP_UNLISTEN, 30, "p", NULL, 0), 0);
    tsu_expect(l, &f, TS_OP_UNLISTEN, 30, TS_ST_OK);
    assert_int_equal(f.len, 0);
    assert_int_equal(tsu_send_name(l, TS_OP_UNLISTEN, 31, "p", NULL, 0), 0);
    tsu_expect(l, &f, TS_OP_UNLISTEN, 31, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    tsu_put_int(w, TS_OP_PUT, "p", 1, NULL);
    tsu_expect(w, &f, TS_OP_NOTIFY, 0, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsh_send(l, TS_OP_PING, 32, NULL, 0), 0);
    tsu_expect(l, &f, TS_OP_PING, 32, TS_ST_OK);
    /* Other bins do not notify p's listeners. */
    tsu_put_int(w, TS_OP_PUT, "other", 1, NULL);
    assert_int_equal(tsh_send(w, TS_OP_PING, 33, NULL, 0), 0);
    tsu_expect(w, &f, TS_OP_PING, 33, TS_ST_OK);
    assert_true(tsu_stat(w, "notifications_sent") >= 12);
    close(w);
    close(l);
}

static void test_listen_reports_state(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    tsu_put_int(fd, TS_OP_APPEND, "s", 1, NULL);
    uint64_t v2 = tsu_put_int(fd, TS_OP_APPEND, "s", 2, NULL);
    tsu_frame f;
    assert_int_equal(tsu_send_name(fd, TS_OP_LISTEN, 1, "s", NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_LISTEN, 1, TS_ST_OK);
    uint64_t v;
    uint32_t n;
    tsu_state(&f, &v, &n);
    assert_int_equal(v, v2);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "listeners"), 1);
    close(fd);
}

static void test_wait_immediate(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint64_t v = tsu_put_int(fd, TS_OP_PUT, "w", 1, NULL);
    tsu_frame f;
    uint64_t got;
    uint32_t n;
    assert_int_equal(tsu_send_wait(fd, 1, "w", v - 1, 10000), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 1, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    /* timeout 0 answers now: TIMEOUT with the current state. */
    assert_int_equal(tsu_send_wait(fd, 2, "w", v, 0), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 2, TS_ST_TIMEOUT);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);
    /* A missing bin has version 0. */
    assert_int_equal(tsu_send_wait(fd, 3, "nothing", 0, 0), 0);
    tsu_expect(fd, &f, TS_OP_WAIT, 3, TS_ST_TIMEOUT);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, 0);
    assert_int_equal(n, 0);
    tsu_frame_free(&f);
    close(fd);
}

static void test_wait_on_change(void **state)
{
    (void)state;
    int a = tsu_client(&srv);
    int b = tsu_client(&srv);
    uint64_t v = tsu_put_int(b, TS_OP_PUT, "w", 1, NULL);
    tsu_frame f;
    assert_int_equal(tsu_send_wait(a, 1, "w", v, 20000), 0);
    assert_int_equal(tsu_send_wait(a, 2, "missing", 0, 20000), 0);
    /* Other requests on the same connection are answered while the waits are parked. */
    assert_int_equal(tsh_send(a, TS_OP_PING, 3, NULL, 0), 0);
    tsu_expect(a, &f, TS_OP_PING, 3, TS_ST_OK);
    assert_int_equal(tsu_stat(b, "waiters"), 2);
    uint64_t v2 = tsu_put_int(b, TS_OP_APPEND, "w", 2, NULL);
    tsu_expect(a, &f, TS_OP_WAIT, 1, TS_ST_OK);
    uint64_t got;
    uint32_t n;
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v2);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    /* Creating a missing bin wakes its waiter with the new version. */
    uint64_t v3 = tsu_put_int(b, TS_OP_PUT, "missing", 5, NULL);
    tsu_expect(a, &f, TS_OP_WAIT, 2, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v3);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(b, "waiters"), 0);
    close(a);
    close(b);
}

/*
 * One rule for WAIT, checked at once and on every change alike: the bin exists and its version
 * is greater than after_version. A GET that empties a bin and a DELETE leave no bin (version 0),
 * so they never answer a waiter, whichever way it is checked; a GET that leaves items does.
 */
static void test_wait_removal_rule(void **state)
{
    (void)state;
    int a = tsu_client(&srv);
    int b = tsu_client(&srv);
    tsu_frame f;
    uint64_t got;
    uint32_t n;

    /* A GET that empties the bin: the pending WAIT stays pending, the next PUT answers it. */
    uint64_t v = tsu_put_int(a, TS_OP_PUT, "r", 1, NULL);
    assert_int_equal(tsu_send_wait(b, 1, "r", v, 20000), 0);
    assert_int_equal(tsh_send(b, TS_OP_PING, 2, NULL, 0), 0);
    tsu_expect(b, &f, TS_OP_PING, 2, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_items it;
    tsu_get(a, TS_OP_GET, "r", 0, &it);
    tsu_frame_free(&it.f);
    assert_int_equal(tsh_send(b, TS_OP_PING, 3, NULL, 0), 0);
    tsu_expect(b, &f, TS_OP_PING, 3, TS_ST_OK);
    tsu_frame_free(&f);
    /* The immediate check agrees: the emptied bin does not satisfy after_version v. */
    assert_int_equal(tsu_send_wait(b, 4, "r", v, 0), 0);
    tsu_expect(b, &f, TS_OP_WAIT, 4, TS_ST_TIMEOUT);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, 0);
    assert_int_equal(n, 0);
    tsu_frame_free(&f);
    uint64_t v2 = tsu_put_int(a, TS_OP_PUT, "r", 2, NULL);
    tsu_expect(b, &f, TS_OP_WAIT, 1, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v2);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);

    /* A DELETE: the same, on both paths. */
    assert_int_equal(tsu_send_wait(b, 5, "r", v2, 20000), 0);
    assert_int_equal(tsu_send_name(a, TS_OP_DELETE, 6, "r", NULL, 0), 0);
    tsu_expect(a, &f, TS_OP_DELETE, 6, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_wait(b, 7, "r", v2, 0), 0);
    tsu_expect(b, &f, TS_OP_WAIT, 7, TS_ST_TIMEOUT);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, 0);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(a, "waiters"), 1);
    uint64_t v3 = tsu_put_int(a, TS_OP_APPEND, "r", 3, NULL);
    tsu_expect(b, &f, TS_OP_WAIT, 5, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, v3);
    assert_int_equal(n, 1);
    tsu_frame_free(&f);

    /* A GET that leaves items is a change of an existing bin: it answers, on both paths. */
    tsu_put_int(a, TS_OP_APPEND, "r", 4, NULL);
    uint64_t v4 = tsu_put_int(a, TS_OP_APPEND, "r", 5, NULL);
    assert_int_equal(tsu_send_wait(b, 8, "r", v4, 20000), 0);
    tsu_get(a, TS_OP_GET, "r", 1, &it);
    uint64_t vg = it.version;
    tsu_frame_free(&it.f);
    tsu_expect(b, &f, TS_OP_WAIT, 8, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, vg);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_wait(b, 9, "r", v4, 0), 0);
    tsu_expect(b, &f, TS_OP_WAIT, 9, TS_ST_OK);
    tsu_state(&f, &got, &n);
    assert_int_equal(got, vg);
    assert_int_equal(n, 2);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(a, "waiters"), 0);
    close(a);
    close(b);
}

static void test_wait_timeout(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    uint64_t t0 = now_ms();
    assert_int_equal(tsu_send_wait(fd, 9, "never", 0, 300), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_WAIT, 9, TS_ST_TIMEOUT);
    uint64_t elapsed = now_ms() - t0;
    uint64_t got;
    uint32_t n;
    tsu_state(&f, &got, &n);
    assert_int_equal(got, 0);
    assert_int_equal(n, 0);
    tsu_frame_free(&f);
    /* Generous bounds: not early, and not stuck (the loaded machine may be slow). */
    assert_true(elapsed >= 250);
    assert_true(elapsed < 9000);

    /* Waiters of a closed connection are dropped; the daemon carries on. */
    int gone = tsu_client(&srv);
    assert_int_equal(tsu_send_wait(gone, 1, "never", 0, 60000), 0);
    assert_int_equal(tsh_send(gone, TS_OP_PING, 2, NULL, 0), 0);
    tsu_expect(gone, &f, TS_OP_PING, 2, TS_ST_OK);
    assert_int_equal(tsu_stat(fd, "waiters"), 1);
    close(gone);
    int64_t waiters = 1;
    for (int i = 0; i < 200 && waiters != 0; i++) {
        usleep(10000);
        waiters = tsu_stat(fd, "waiters");
    }
    assert_int_equal(waiters, 0);
    tsu_put_int(fd, TS_OP_PUT, "never", 1, NULL);
    close(fd);
}

static void test_pipelined(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_int(5, &len);
    /* 100 requests in one write, before reading anything. */
    size_t cap = 100 * (TS_HDR_SIZE + 16 + len);
    uint8_t *buf = ts__malloc(cap);
    assert_non_null(buf);
    size_t pos = 0;
    uint8_t ops[100];
    for (uint32_t i = 0; i < 100; i++) {
        uint8_t op = (uint8_t[]){TS_OP_APPEND, TS_OP_PEEK, TS_OP_PING, TS_OP_LIST}[i % 4];
        ops[i] = op;
        uint8_t body[64 + 16];
        size_t blen = 0;
        if (op == TS_OP_APPEND) {
            body[0] = 2;
            memcpy(body + 1, "pp", 2);
            memcpy(body + 3, rec, len);
            blen = 3 + len;
        } else if (op == TS_OP_PEEK) {
            uint8_t mx[4] = {0, 0, 0, 0};
            blen = tsh_name_body(body, sizeof(body), "pp", mx, 4);
        }
        ts__hdr h = {.magic = TS_MAGIC_REQ,
                     .version = TS_PROTO_VERSION,
                     .opcode = op,
                     .request_id = 5000 + i,
                     .body_len = blen};
        ts__hdr_encode(&h, buf + pos);
        memcpy(buf + pos + TS_HDR_SIZE, body, blen);
        pos += TS_HDR_SIZE + blen;
    }
    assert_int_equal(tsh_write_all(fd, buf, pos), 0);
    for (uint32_t i = 0; i < 100; i++) {
        tsu_frame f;
        tsu_expect(fd, &f, ops[i], 5000 + i, TS_ST_OK);
        if (ops[i] == TS_OP_PEEK) {
            assert_int_equal(ts__get_u32le(f.body + 8), i / 4 + 1);
        } else if (ops[i] == TS_OP_APPEND) {
            uint64_t v;
            uint32_t n;
            tsu_state(&f, &v, &n);
            assert_int_equal(n, i / 4 + 1);
        }
        tsu_frame_free(&f);
    }
    ts__free(buf);
    tsu_rec_free(rec, len);
    close(fd);
}

static void test_stats(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "b", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "b", 2, NULL);
    size_t len;
    uint8_t *rec = tsu_rec_int(0, &len);
    tsu_rec_free(rec, len);
    assert_true(tsu_stat(fd, "uptime_ms") >= 0);
    assert_int_equal(tsu_stat(fd, "connections"), 1);
    assert_int_equal(tsu_stat(fd, "bins"), 2);
    assert_int_equal(tsu_stat(fd, "items"), 3);
    assert_int_equal(tsu_stat(fd, "bytes"), (int64_t)(3 * len));
    /* Three small records: three slab slots, in at least one slab. */
    assert_int_equal(tsu_stat(fd, "slab_slots_used"), 3);
    assert_true(tsu_stat(fd, "slabs") >= 1);
    assert_true(tsu_stat(fd, "slab_bytes") >= (int64_t)(3 * len));
    assert_true(tsu_stat(fd, "slab_meta_bytes") > 0);
    assert_true(tsu_stat(fd, "slab_empty_kept_bytes") >= 0);
    assert_true(tsu_stat(fd, "max_memory") > 0);
    assert_int_equal(tsu_stat(fd, "ops_put"), 1);
    assert_int_equal(tsu_stat(fd, "ops_append"), 2);
    assert_int_equal(tsu_stat(fd, "ops_hello"), 1);
    assert_int_equal(tsu_stat(fd, "protocol_errors"), 0);
    assert_int_equal(tsu_stat(fd, "notifications_sent"), 0);
    assert_true(tsu_stat(fd, "ops_stats") >= 9);
    close(fd);
}

static void test_unix_socket(void **state)
{
    (void)state;
    int fd = tsh_connect_unix(srv.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(3 << 20, 7, &len);
    tsu_store(fd, TS_OP_PUT, "u", rec, len, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_GET, "u", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], len);
    assert_memory_equal(it.item[0], rec, len);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, len);
    close(fd);
}

static void test_large_item(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    /* 17 MiB plus a bit: several 4 MiB write chunks and an unaligned tail. */
    uint8_t *rec = tsu_rec_bytes((17u << 20) + 13, 3, &len);
    tsu_store(fd, TS_OP_PUT, "big", rec, len, NULL);
    int readers[3];
    for (int i = 0; i < 3; i++) {
        readers[i] = tsu_client(&srv);
        assert_int_equal(tsu_send_get(readers[i], TS_OP_PEEK, 1, "big", 0), 0);
    }
    /* Three readers share the one stored buffer. */
    for (int i = 0; i < 3; i++) {
        tsu_items it;
        tsu_frame f;
        tsu_expect(readers[i], &f, TS_OP_PEEK, 1, TS_ST_OK);
        assert_int_equal(ts__get_u32le(f.body + 8), 1);
        assert_int_equal(ts__get_u64le(f.body + 16), len);
        assert_memory_equal(f.body + 64, rec, len);
        tsu_frame_free(&f);
        (void)it;
        close(readers[i]);
    }
    tsu_items it;
    tsu_get(fd, TS_OP_GET, "big", 0, &it);
    assert_memory_equal(it.item[0], rec, len);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, len);
    close(fd);
}

static void test_lz4_bodies(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    uint8_t hello[4] = {1, TS_HELLO_LZ4, 0, 0};
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_int_equal(f.body[1], TS_HELLO_LZ4);
    tsu_frame_free(&f);

    size_t len;
    uint8_t *rec = tsu_rec_bytes(256 << 10, 0, &len);
    const char *name = "zipped";
    size_t raw_len = 1 + strlen(name) + len;
    uint8_t *raw = ts__malloc(raw_len);
    raw[0] = (uint8_t)strlen(name);
    memcpy(raw + 1, name, strlen(name));
    memcpy(raw + 1 + strlen(name), rec, len);
    size_t cap = ts__lz4_bound(raw_len);
    uint8_t *z = ts__malloc(cap);
    size_t zlen;
    assert_int_equal(ts__lz4_compress(raw, raw_len, z, cap, &zlen), 0);
    assert_true(zlen < raw_len);
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_APPEND,
                 .flags = TS_FLAG_LZ4,
                 .request_id = 2,
                 .body_len = zlen};
    ts__hdr_encode(&h, hdr);
    assert_int_equal(tsh_write_all(fd, hdr, sizeof(hdr)), 0);
    assert_int_equal(tsh_write_all(fd, z, zlen), 0);
    tsu_expect(fd, &f, TS_OP_APPEND, 2, TS_ST_OK);
    tsu_frame_free(&f);

    /* A compressed control request (PEEK) works too. */
    uint8_t pbody[32];
    uint8_t mx[4] = {0, 0, 0, 0};
    size_t plen = tsh_name_body(pbody, sizeof(pbody), name, mx, 4);
    uint8_t pz[128];
    size_t pzlen;
    int rc = ts__lz4_compress(pbody, plen, pz, sizeof(pz), &pzlen);
    if (rc == 0) {
        h.opcode = TS_OP_PEEK;
        h.request_id = 3;
        h.body_len = pzlen;
        ts__hdr_encode(&h, hdr);
        assert_int_equal(tsh_write_all(fd, hdr, sizeof(hdr)), 0);
        assert_int_equal(tsh_write_all(fd, pz, pzlen), 0);
        tsu_expect(fd, &f, TS_OP_PEEK, 3, TS_ST_OK);
        tsu_frame_free(&f);
    }

    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, name, 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], len);
    assert_memory_equal(it.item[0], rec, len);
    tsu_frame_free(&it.f);
    close(fd);

    /* Without negotiating lz4, a compressed body is a protocol error. */
    fd = tsu_client(&srv);
    h.opcode = TS_OP_APPEND;
    h.request_id = 4;
    h.body_len = zlen;
    ts__hdr_encode(&h, hdr);
    assert_int_equal(tsh_write_all(fd, hdr, sizeof(hdr)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);

    ts__free(z);
    ts__free(raw);
    tsu_rec_free(rec, len);
    tsu_check_healthy(&srv);
}

/* A compressed body of src (n <= 269 bytes) as one LZ4 block of literals only; its length. */
static size_t lz4_literals(const uint8_t *src, size_t n, uint8_t *out)
{
    size_t o = 0;
    ts__put_u64le(out, n);
    o += 8;
    if (n < 15) {
        out[o++] = (uint8_t)(n << 4);
    } else {
        out[o++] = 0xF0;
        out[o++] = (uint8_t)(n - 15);
    }
    memcpy(out + o, src, n);
    return o + n;
}

/* A PUT of body (blen bytes), raw or compressed, on a new connection: status, then the close. */
static void put_refused(int lz4, const uint8_t *body, size_t blen, uint16_t status)
{
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    uint8_t hello[4] = {1, TS_HELLO_LZ4, 0, 0};
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    tsu_frame_free(&f);
    uint8_t frame[TS_HDR_SIZE + 8 + 2 + 64];
    size_t n = blen;
    if (lz4)
        n = lz4_literals(body, blen, frame + TS_HDR_SIZE);
    else
        memcpy(frame + TS_HDR_SIZE, body, blen);
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .flags = lz4 ? TS_FLAG_LZ4 : 0,
                 .request_id = 2,
                 .body_len = n};
    ts__hdr_encode(&h, frame);
    assert_int_equal(tsh_write_all(fd, frame, TS_HDR_SIZE + n), 0);
    tsu_expect_error_close(fd, status);
    close(fd);
}

/*
 * A record shorter than its 16-byte header is BAD_RECORD whether the body came raw or
 * compressed; a name longer than the body, or no name at all, is BAD_REQUEST either way.
 */
static void test_short_record(void **state)
{
    (void)state;
    uint8_t body[2 + 15];
    memset(body, 0, sizeof(body));
    body[0] = 1;
    body[1] = 's';
    for (size_t rl = 0; rl < 16; rl += 5) {
        put_refused(0, body, 2 + rl, TS_ST_BAD_RECORD);
        put_refused(1, body, 2 + rl, TS_ST_BAD_RECORD);
    }
    const uint8_t longname[3] = {5, 'a', 'b'};
    put_refused(0, longname, sizeof(longname), TS_ST_BAD_REQUEST);
    put_refused(1, longname, sizeof(longname), TS_ST_BAD_REQUEST);
    put_refused(1, longname, 0, TS_ST_BAD_REQUEST);
    tsu_check_healthy(&srv);
}

/* The end of a connection at shutdown: the connection-level SHUTTING_DOWN frame, then EOF. */
static void expect_conn_shutdown(int fd)
{
    tsu_frame f;
    tsu_expect(fd, &f, 0, 0, TS_ST_SHUTTING_DOWN);
    ts__msg_error e;
    assert_int_equal(ts__msg_error_decode(f.body, f.len, &e), 0);
    assert_true(e.len > 0);
    tsu_frame_free(&f);
    assert_true(tsh_wait_closed(fd, 10000));
}

#define STOP_UPLOAD_LEN ((size_t)64 << 10) /* bytes of the record whose body is cut short */

/*
 * SIGTERM: every request still waiting for its reply gets SHUTTING_DOWN (a pending WAIT, a PUT
 * whose body is still arriving), then every connection, one before HELLO included, gets the
 * connection-level SHUTTING_DOWN frame (opcode 0, request id 0) before its end; the daemon then
 * exits cleanly (the teardown checks that).
 */
static void test_stop_answers_pending(void **state)
{
    (void)state;
    int waiter = tsu_client(&srv);
    assert_int_equal(tsu_send_wait(waiter, 2, "never", 0, 60000), 0);
    tsu_frame f;
    assert_int_equal(tsh_send(waiter, TS_OP_PING, 3, NULL, 0), 0);
    tsu_expect(waiter, &f, TS_OP_PING, 3, TS_ST_OK); /* the WAIT is pending now */
    tsu_frame_free(&f);
    int idle = tsu_client(&srv);
    int fresh = tsh_connect_tcp(srv.port);
    assert_true(fresh >= 0);

    /* A PUT whose header, name and half its record are in; the rest never comes. */
    int upl = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(STOP_UPLOAD_LEN, 1, &len);
    uint8_t head[TS_HDR_SIZE + 8];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .request_id = 7,
                 .body_len = 1 + 4 + len};
    ts__hdr_encode(&h, head);
    memcpy(head + TS_HDR_SIZE,
           "\x04"
           "half",
           5);
    assert_int_equal(tsh_write_all(upl, head, TS_HDR_SIZE + 5), 0);
    assert_int_equal(tsh_write_all(upl, rec, len / 2), 0);
    tsu_rec_free(rec, len);
    /* The upload has begun once its reservation shows. */
    int64_t reserved = 0;
    for (int i = 0; i < 500 && reserved < (int64_t)len; i++) {
        reserved = tsu_stat(idle, "bytes_reserved");
        if (reserved < (int64_t)len)
            usleep(10000);
    }
    assert_true(reserved >= (int64_t)len);

    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    tsu_expect(waiter, &f, TS_OP_WAIT, 2, TS_ST_SHUTTING_DOWN);
    ts__msg_error e;
    assert_int_equal(ts__msg_error_decode(f.body, f.len, &e), 0);
    assert_true(e.len > 0);
    tsu_frame_free(&f);
    expect_conn_shutdown(waiter);
    tsu_expect(upl, &f, TS_OP_PUT, 7, TS_ST_SHUTTING_DOWN);
    tsu_frame_free(&f);
    expect_conn_shutdown(upl);
    expect_conn_shutdown(idle);
    expect_conn_shutdown(fresh);
    close(waiter);
    close(upl);
    close(idle);
    close(fresh);
}

/*
 * SIGTERM while a large LIST is being sorted off the loop with a PING queued behind it: each gets
 * exactly one reply, in order (OK when it was done before the stop, else SHUTTING_DOWN), then the
 * connection-level SHUTTING_DOWN frame and the end of the stream.
 */
static void test_stop_answers_held_list(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    int other = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_int(5, &len);
    char name[32];
    for (uint32_t i = 0; i < N_LIST_BINS; i++) {
        snprintf(name, sizeof(name), "S%u", i);
        assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 1, name, rec, len), 0);
    }
    tsu_rec_free(rec, len);
    tsu_frame f;
    for (uint32_t i = 0; i < N_LIST_BINS; i++) {
        tsu_expect(fd, &f, TS_OP_PUT, 1, TS_ST_OK);
        tsu_frame_free(&f);
    }
    uint8_t buf[2 * TS_HDR_SIZE];
    const uint8_t ops[2] = {TS_OP_LIST, TS_OP_PING};
    for (uint32_t i = 0; i < 2; i++) {
        ts__hdr h = {.magic = TS_MAGIC_REQ,
                     .version = TS_PROTO_VERSION,
                     .opcode = ops[i],
                     .request_id = 30 + i};
        ts__hdr_encode(&h, buf + i * TS_HDR_SIZE);
    }
    assert_int_equal(tsh_write_all(fd, buf, sizeof(buf)), 0);
    /* The LIST has been read once it is counted. */
    int64_t lists = 0;
    for (int i = 0; i < 500 && lists == 0; i++) {
        lists = tsu_stat(other, "lists_offloop");
        if (lists == 0)
            usleep(2000);
    }
    assert_int_equal(lists, 1);
    assert_int_equal(kill(srv.pid, SIGTERM), 0);
    for (uint32_t i = 0; i < 2; i++) {
        assert_int_equal(tsu_recv(fd, &f), 0);
        assert_int_equal(f.h.opcode, ops[i]);
        assert_int_equal(f.h.request_id, 30 + i);
        assert_true(f.h.status == TS_ST_OK || f.h.status == TS_ST_SHUTTING_DOWN);
        tsu_frame_free(&f);
    }
    expect_conn_shutdown(fd);
    expect_conn_shutdown(other);
    close(fd);
    close(other);
}

#define T(f) cmocka_unit_test_setup_teardown(f, start, stop)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_hello),
        T(test_ping_and_save),
        T(test_put_replaces),
        T(test_append_creates_and_extends),
        T(test_get_removes),
        T(test_get_max_items),
        T(test_delete),
        T(test_list_sorted),
        T(test_list_large),
        T(test_list_large_in_order),
        T(test_names_with_spaces_and_empty),
        T(test_notifications),
        T(test_listen_reports_state),
        T(test_wait_immediate),
        T(test_wait_on_change),
        T(test_wait_timeout),
        T(test_wait_removal_rule),
        T(test_pipelined),
        T(test_stats),
        T(test_unix_socket),
        T(test_large_item),
        T(test_lz4_bodies),
        T(test_short_record),
        T(test_stop_answers_pending),
        T(test_stop_answers_held_list),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
