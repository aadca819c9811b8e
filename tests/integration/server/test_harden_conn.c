/*
 * tensord's connections under abuse: uploads that stall or never finish (reserved as they
 * arrive, cut at --body-timeout), a big compressed upload inflated off the loop while others are
 * served, compressed bodies whose raw length is over a limit (TOO_LARGE at the header, every
 * opcode), a flood of connections before HELLO (--max-unauth-clients), and the memory counted
 * against --max-memory besides item bytes (bins, queued output, items replaced while a reply
 * still sends them), with STATS.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "compress.h"
#include "test_harden_util.h"

static tsh_server s;

/* Bytes; the body limit of requests other than PUT and APPEND (PROTOCOL.md section 12). */
#define CTRL_BODY_LIMIT 4096

static int kill_leftover(void **state)
{
    (void)state;
    if (s.pid > 0) {
        tsh_server_kill(&s);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    return 0;
}

static void stop_server(void)
{
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
    memset(&s, 0, sizeof(s));
}

/* Send a PUT header and name declaring a record of rec_len bytes, plus the first `first` bytes. */
static void send_partial_put(int fd, uint32_t rid, const char *name, uint64_t rec_len, size_t first)
{
    uint8_t buf[TS_HDR_SIZE + 256 + 4096];
    size_t nl = strlen(name);
    assert_true(first <= 4096 && nl < 256);
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .request_id = rid,
                 .body_len = 1 + nl + rec_len};
    ts__hdr_encode(&h, buf);
    buf[TS_HDR_SIZE] = (uint8_t)nl;
    memcpy(buf + TS_HDR_SIZE + 1, name, nl);
    memset(buf + TS_HDR_SIZE + 1 + nl, 0, first);
    assert_int_equal(tsh_write_all(fd, buf, TS_HDR_SIZE + 1 + nl + first), 0);
}

/* A connection that said HELLO asking for LZ4 (granted). */
static int lz4_client(void)
{
    int fd = tsh_connect_tcp(s.port);
    assert_true(fd >= 0);
    uint8_t hello[4] = {1, TS_HELLO_LZ4, 0, 0};
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_int_equal(f.body[1], TS_HELLO_LZ4);
    tsu_frame_free(&f);
    return fd;
}

/*
 * A PUT frame whose body (name and record) is LZ4-compressed, for a connection that asked for it:
 * malloc'ed header and body, *frame_len bytes in all.
 */
static uint8_t *lz4_put_frame(uint32_t rid, const char *name, const uint8_t *rec, size_t len,
                              size_t *frame_len)
{
    size_t nl = strlen(name);
    size_t raw = 1 + nl + len;
    uint8_t *body = malloc(raw);
    assert_non_null(body);
    body[0] = (uint8_t)nl;
    memcpy(body + 1, name, nl);
    memcpy(body + 1 + nl, rec, len);
    size_t cap = ts__lz4_bound(raw);
    uint8_t *frame = malloc(TS_HDR_SIZE + cap);
    assert_non_null(frame);
    size_t clen = 0;
    assert_int_equal(ts__lz4_compress(body, raw, frame + TS_HDR_SIZE, cap, &clen), 0);
    free(body);
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .flags = TS_FLAG_LZ4,
                 .request_id = rid,
                 .body_len = clen};
    ts__hdr_encode(&h, frame);
    *frame_len = TS_HDR_SIZE + clen;
    return frame;
}

/* Send lz4_put_frame's frame on fd. */
static void send_lz4_put(int fd, uint32_t rid, const char *name, const uint8_t *rec, size_t len)
{
    size_t n;
    uint8_t *frame = lz4_put_frame(rid, name, rec, len, &n);
    assert_int_equal(tsh_write_all(fd, frame, n), 0);
    free(frame);
}

/*
 * f is an OUT_OF_MEMORY reply for the memory limit: its message names the total used and every
 * part of it, and the parts add up to the total. Returns the orphaned items' part.
 */
static unsigned long long expect_oom_parts(const tsu_frame *f)
{
    static const char head[] = "memory limit reached: ";
    const uint8_t *p = memmem(f->body, f->len, head, sizeof(head) - 1);
    assert_non_null(p);
    char msg[TS_MAX_ERRMSG + 1];
    size_t n = f->len - (size_t)(p - f->body);
    if (n > TS_MAX_ERRMSG)
        n = TS_MAX_ERRMSG;
    memcpy(msg, p, n);
    msg[n] = '\0';
    unsigned long long used, limit, items, orphaned, overhead, output, uploads, conns, need;
    assert_int_equal(sscanf(msg,
                            "memory limit reached: %llu of %llu bytes used (items %llu, orphaned "
                            "items %llu, bin and item overhead %llu, output buffers %llu, uploads "
                            "in progress %llu, connections %llu); %llu more needed",
                            &used, &limit, &items, &orphaned, &overhead, &output, &uploads, &conns,
                            &need),
                     9);
    assert_true(items + orphaned + overhead + output + uploads + conns == used);
    assert_true(need > 0);
    return orphaned;
}

/*
 * Uploads that declare large bodies and stop halfway reserve only what arrived plus one step,
 * so they do not lock every other writer out with OUT_OF_MEMORY.
 */
static void test_partial_uploads_do_not_lock_out(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "64m", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    enum { NSLOW = 6 };
    int slow[NSLOW];
    for (int i = 0; i < NSLOW; i++) {
        slow[i] = tsu_client(&s);
        char name[16];
        snprintf(name, sizeof(name), "slow%d", i);
        /* 6 x 16 MiB declared: more than the limit if reserved at once. */
        send_partial_put(slow[i], 7, name, (uint64_t)16 << 20, 1024);
    }
    int fd = tsu_client(&s);
    /* Wait until every partial upload is in. */
    for (int i = 0; i < 200 && tsu_stat(fd, "bytes_reserved") < NSLOW * 1024; i++)
        th_sleep_ms(10);
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)1 << 20, 3, &len);
    tsu_store(fd, TS_OP_PUT, "other", rec, len, NULL);
    tsu_rec_free(rec, len);
    assert_true(tsu_stat(fd, "bytes_reserved") <= (int64_t)NSLOW * (int64_t)(4 << 20));
    for (int i = 0; i < NSLOW; i++)
        close(slow[i]);
    for (int i = 0; i < 200 && tsu_stat(fd, "bytes_reserved") != 0; i++)
        th_sleep_ms(10);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    close(fd);
    stop_server();
}

/* A body that stops arriving is cut after --body-timeout, and its reservation returned. */
static void test_stalled_body_is_cut(void **state)
{
    (void)state;
    const char *args[] = {"--body-timeout", "1", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsu_client(&s);
    send_partial_put(fd, 5, "stalled", (uint64_t)8 << 20, 100);
    uint64_t t0 = th_now_ms();
    tsu_frame f;
    assert_int_equal(tsu_recv(fd, &f), 0);
    assert_int_equal(f.h.status, TS_ST_TIMEOUT);
    assert_int_equal(f.h.request_id, 0);
    assert_true(f.len > 0 && memmem(f.body, f.len, "body-timeout", 12) != NULL);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    assert_true(th_now_ms() - t0 < 5000);
    close(fd);
    /* A header cut in half stalls the same way. */
    fd = tsu_client(&s);
    uint8_t half[TS_HDR_SIZE / 2] = {TS_MAGIC_REQ, TS_PROTO_VERSION, TS_OP_PING};
    assert_int_equal(tsh_write_all(fd, half, sizeof(half)), 0);
    assert_int_equal(tsu_recv(fd, &f), 0);
    assert_int_equal(f.h.status, TS_ST_TIMEOUT);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    assert_int_equal(tsu_stat(fd, "body_timeouts"), 2);
    close(fd);
    stop_server();
}

/* 1 when fd has bytes to read right now. */
/*
 * A compressed PUT that inflates to 256 MiB is inflated and validated off the loop: another
 * connection's PING is answered before the big PUT's reply, and the record stored is the one
 * sent.
 */
static void test_big_lz4_inflated_off_loop(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "0", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    const size_t n = ((size_t)256 << 20) - 4096;
    uint64_t dims[1] = {n};
    size_t rec_len;
    uint8_t *rec = tsu_rec_tensor_raw(TS_UINT8, 1, dims, 0, n, n, &rec_len);
    static const char name[] = "big";
    size_t flen;
    uint8_t *frame = lz4_put_frame(9, name, rec, rec_len, &flen);
    int big = lz4_client();
    int other = tsu_client(&s);
    assert_int_equal(tsh_write_all(big, frame, flen), 0);
    assert_int_equal(tsh_send(other, TS_OP_PING, 2, NULL, 0), 0);
    /*
     * Only the order is checked, not how long anything takes: the first reply to become readable
     * is the PING's, on the other connection, because the loop keeps answering while the big
     * body is inflated (inflating on the loop would hold the PING behind the big PUT's reply).
     * The wait is bounded in time so that a stuck server fails the test instead of hanging it.
     */
    struct pollfd p[2] = {{.fd = other, .events = POLLIN}, {.fd = big, .events = POLLIN}};
    assert_true(poll(p, 2, 30000) > 0);
    assert_true((p[0].revents & POLLIN) != 0);
    tsu_frame f;
    tsu_expect(other, &f, TS_OP_PING, 2, TS_ST_OK);
    tsu_frame_free(&f);
    tsu_expect(big, &f, TS_OP_PUT, 9, TS_ST_OK);
    tsu_frame_free(&f);
    /* The record stored is the one sent. */
    tsu_items it;
    tsu_get(other, TS_OP_PEEK, name, 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], rec_len);
    assert_memory_equal(it.item[0], rec, rec_len);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, rec_len);
    assert_int_equal(tsu_stat(other, "bytes_reserved"), 0);
    /*
     * Shutting down while a body is being inflated: the connection is closed at once and freed
     * when the work comes back; the daemon exits cleanly (and, under ASan, without leaks).
     */
    close(big);
    close(other);
    big = lz4_client();
    ts__hdr h; /* the same PUT again, as request 10 */
    assert_int_equal(ts__hdr_decode(frame, TS_MAGIC_REQ, &h), 0);
    h.request_id = 10;
    ts__hdr_encode(&h, frame);
    assert_int_equal(tsh_write_all(big, frame, flen), 0);
    free(frame);
    th_sleep_ms(20);
    stop_server();
    close(big);
}

/*
 * Records large enough to be validated off the loop, pipelined with a PING on one connection:
 * the replies come back in request order and both records are stored.
 */
static void test_offloop_keeps_order(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)8 << 20, 5, &len);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 1, "p", rec, len), 0);
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 2, "p", rec, len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 3, NULL, 0), 0);
    tsu_frame f;
    for (uint32_t rid = 1; rid <= 3; rid++) {
        tsu_expect(fd, &f,
                   rid == 1   ? TS_OP_PUT
                   : rid == 2 ? TS_OP_APPEND
                              : TS_OP_PING,
                   rid, TS_ST_OK);
        tsu_frame_free(&f);
    }
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "p", 0, &it);
    assert_int_equal(it.n, 2);
    assert_int_equal(it.item_len[1], len);
    assert_memory_equal(it.item[1], rec, len);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, len);
    close(fd);
    stop_server();
}

/* A compressed header declaring raw_len, with the first 8 body bytes; expect TOO_LARGE at once. */
static void expect_raw_too_large(int fd, uint8_t op, uint64_t raw_len)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = TS_FLAG_LZ4,
                 .request_id = 77,
                 .body_len = 100};
    uint8_t frame[TS_HDR_SIZE + TS_LZ4_PREFIX];
    ts__hdr_encode(&h, frame);
    ts__put_u64le(frame + TS_HDR_SIZE, raw_len);
    assert_int_equal(tsh_write_all(fd, frame, sizeof(frame)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, op, 77, TS_ST_TOO_LARGE);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
}

/*
 * Send one request header (only) on a fresh connection, after HELLO when helloed, and expect the
 * error status and the connection closed.
 */
static void expect_header_status(int helloed, uint8_t version, uint8_t op, uint8_t flags,
                                 uint16_t reserved, uint64_t body_len, uint16_t status)
{
    int fd = helloed ? tsu_client(&s) : tsh_connect_tcp(s.port);
    assert_true(fd >= 0);
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = version,
                 .opcode = op,
                 .flags = flags,
                 .request_id = 91,
                 .body_len = body_len};
    uint8_t frame[TS_HDR_SIZE];
    ts__hdr_encode(&h, frame);
    frame[6] = (uint8_t)reserved; /* the u16 reserved field (ts__hdr_encode writes 0) */
    assert_int_equal(tsh_write_all(fd, frame, sizeof(frame)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, op, 91, status);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
}

/*
 * A header that breaks several rules is answered with the status of the first rule in the order
 * of PROTOCOL.md section 5: magic, version, flags, reserved fields, status, the pre-HELLO size,
 * HELLO first, LZ4 granted, --max-frame, the opcode, the control body limit.
 */
static void test_header_rule_precedence(void **state)
{
    (void)state;
    const char *args[] = {"--max-frame", "1m", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    const uint64_t big = (uint64_t)2 << 20; /* over --max-frame */
    const uint8_t v = TS_PROTO_VERSION;
    /* Version and reserved field both wrong, body too large: the version decides. */
    expect_header_status(1, v + 1, TS_OP_PING, 0, 1, big, TS_ST_UNSUPPORTED_VERSION);
    /* Reserved field set and body too large: BAD_REQUEST, not TOO_LARGE. */
    expect_header_status(1, v, TS_OP_PING, 0, 1, big, TS_ST_BAD_REQUEST);
    /* Before HELLO, LZ4 not granted and a body over 4096 bytes: the size decides. */
    expect_header_status(0, v, TS_OP_HELLO, TS_FLAG_LZ4, 0, CTRL_BODY_LIMIT + 1, TS_ST_TOO_LARGE);
    /* Before HELLO, not HELLO and over 4096 bytes: the size decides. */
    expect_header_status(0, v, TS_OP_PING, 0, 0, CTRL_BODY_LIMIT + 1, TS_ST_TOO_LARGE);
    /* LZ4 not granted and over --max-frame: BAD_REQUEST. */
    expect_header_status(1, v, TS_OP_PUT, TS_FLAG_LZ4, 0, big, TS_ST_BAD_REQUEST);
    /* An unknown opcode over --max-frame: TOO_LARGE. */
    expect_header_status(1, v, 0x55, 0, 0, big, TS_ST_TOO_LARGE);
    /* An unknown opcode over the control body limit, within --max-frame: UNKNOWN_OPCODE. */
    expect_header_status(1, v, 0x55, 0, 0, CTRL_BODY_LIMIT + 1, TS_ST_UNKNOWN_OPCODE);
    /* NOTIFY is no request: UNKNOWN_OPCODE. */
    expect_header_status(1, v, TS_OP_NOTIFY, 0, 0, 0, TS_ST_UNKNOWN_OPCODE);
    tsu_check_healthy(&s);
    stop_server();
}

/* A compressed body's raw length over the limit is TOO_LARGE at the header, for every opcode. */
static void test_raw_len_checked_at_header(void **state)
{
    (void)state;
    const char *args[] = {"--max-frame", "3g", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    static const uint8_t ops[] = {TS_OP_PING,     TS_OP_GET,  TS_OP_PEEK,
                                  TS_OP_DELETE,   TS_OP_LIST, TS_OP_LISTEN,
                                  TS_OP_UNLISTEN, TS_OP_WAIT, TS_OP_STATS};
    for (size_t i = 0; i < sizeof(ops); i++) {
        int fd = lz4_client();
        expect_raw_too_large(fd, ops[i], (uint64_t)1 << 30);
        close(fd);
        fd = lz4_client();
        expect_raw_too_large(fd, ops[i], CTRL_BODY_LIMIT + 1);
        close(fd);
    }
    /* Above LZ4's own limit while within --max-frame: TOO_LARGE, not a malformed body. */
    static const uint8_t up[] = {TS_OP_PUT, TS_OP_APPEND};
    for (size_t i = 0; i < sizeof(up); i++) {
        int fd = lz4_client();
        expect_raw_too_large(fd, up[i], TS_LZ4_MAX_RAW + 1);
        close(fd);
        fd = lz4_client();
        expect_raw_too_large(fd, up[i], (uint64_t)4 << 30);
        close(fd);
    }
    tsu_check_healthy(&s);
    stop_server();
}

/* Connections that never say HELLO cannot take the places of authenticated clients. */
static void test_unauth_flood_leaves_room(void **state)
{
    (void)state;
    char tok[300];
    snprintf(tok, sizeof(tok), "/tmp/ts-conn-token-%d", (int)getpid());
    static const char token[] = "s3cret-token";
    assert_int_equal(th_write_file(tok, token, strlen(token)), 0);
    const char *args[] = {"--auth-token-file",
                          tok,
                          "--allow-plain-token",
                          "--max-clients",
                          "4",
                          "--max-unauth-clients",
                          "8",
                          NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    enum { NFLOOD = 8 };
    int flood[NFLOOD];
    for (int i = 0; i < NFLOOD; i++) {
        flood[i] = tsh_connect_tcp(s.port);
        assert_true(flood[i] >= 0);
    }
    /* One more before HELLO: the oldest waiting one is closed, with a clear message. */
    tsu_frame f;
    int extra = tsh_connect_tcp(s.port);
    assert_true(extra >= 0);
    assert_int_equal(tsu_recv(flood[0], &f), 0);
    assert_int_equal(f.h.status, TS_ST_TOO_MANY_CLIENTS);
    assert_true(memmem(f.body, f.len, "before HELLO", 12) != NULL);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(flood[0], 5000), 1);
    /* The authenticated clients all get in. */
    int ok[4];
    for (int i = 0; i < 4; i++) {
        ok[i] = tsh_connect_tcp(s.port);
        assert_true(ok[i] >= 0);
        assert_int_equal(th_send_hello(ok[i], 1, token, strlen(token)), 0);
        tsu_expect(ok[i], &f, TS_OP_HELLO, 1, TS_ST_OK);
        tsu_frame_free(&f);
    }
    assert_true(tsu_stat(ok[0], "connections_unauth") <= 8);
    assert_int_equal(tsu_stat(ok[0], "connections"), 4 + tsu_stat(ok[0], "connections_unauth"));
    close(extra);
    for (int i = 0; i < NFLOOD; i++)
        close(flood[i]);
    for (int i = 0; i < 4; i++)
        close(ok[i]);
    unlink(tok);
    stop_server();
}

/* STATS reports the bytes sent, and they grow with the replies. */
static void test_bytes_sent(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    int fd = tsu_client(&s);
    int64_t a = tsu_stat(fd, "bytes_sent");
    assert_true(a > 0);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(100000, 1, &len);
    tsu_store(fd, TS_OP_PUT, "b", rec, len, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "b", 0, &it);
    tsu_frame_free(&it.f);
    tsu_rec_free(rec, len);
    int64_t b = tsu_stat(fd, "bytes_sent");
    assert_true(b >= a + (int64_t)len);
    close(fd);
    stop_server();
}

/*
 * Trickling uploads: many connections send a PUT header and a few body bytes, then stall. Each
 * holds only the small first reservation step, so another client's whole PUT of a few MiB still
 * fits under a small --max-memory (with a 4 MiB first step, eight of them took all 32 MiB). Past
 * the share of the limit that unfinished uploads may hold, a new upload is refused and told so.
 */
#define TRICKLERS 64
static void test_trickling_uploads_leave_room(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "16777216", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    size_t big_len;
    uint8_t *big = tsu_rec_bytes((size_t)16 << 20, 3, &big_len);
    static const char tname[] = "t";
    uint8_t frame[TS_HDR_SIZE + 1 + sizeof(tname) + 64];
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .request_id = 1,
                 .body_len = 1 + strlen(tname) + big_len};
    ts__hdr_encode(&h, frame);
    size_t off = TS_HDR_SIZE;
    frame[off++] = (uint8_t)strlen(tname);
    memcpy(frame + off, tname, strlen(tname));
    off += strlen(tname);
    memcpy(frame + off, big, 64);
    off += 64;
    int fds[TRICKLERS];
    for (int i = 0; i < TRICKLERS; i++) {
        fds[i] = tsu_client(&s);
        assert_int_equal(tsh_write_all(fds[i], frame, off), 0);
    }
    int other = tsu_client(&s);
    /* A STATS round trip after the headers: the server has taken them all. */
    int64_t reserved = tsu_stat(other, "bytes_reserved");
    assert_true(reserved > 0);
    assert_true(reserved <= (int64_t)TRICKLERS * (64 << 10));
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)4 << 20, 4, &len);
    assert_int_equal(tsu_send_store(other, TS_OP_PUT, 2, "w", rec, len), 0);
    tsu_frame f;
    tsu_expect(other, &f, TS_OP_PUT, 2, TS_ST_OK);
    tsu_frame_free(&f);
    /* Past half the limit in unfinished uploads, a new upload is refused, and says why. */
    int more[TRICKLERS * 4];
    for (int i = 0; i < TRICKLERS * 4; i++) {
        more[i] = tsu_client(&s);
        assert_int_equal(tsh_write_all(more[i], frame, off), 0);
    }
    assert_true(tsu_stat(other, "bytes_reserved") <= (16 << 20));
    assert_int_equal(tsu_send_store(other, TS_OP_PUT, 3, "x", rec, 1000), 0);
    tsu_expect(other, &f, TS_OP_PUT, 3, TS_ST_OUT_OF_MEMORY);
    assert_non_null(memmem(f.body, f.len, "uploads in progress", 19));
    tsu_frame_free(&f);
    for (int i = 0; i < TRICKLERS * 4; i++)
        close(more[i]);
    for (int i = 0; i < TRICKLERS; i++)
        close(fds[i]);
    close(other);
    tsu_rec_free(rec, len);
    tsu_rec_free(big, big_len);
    stop_server();
}

/* Bins' overhead counts against --max-memory and shows in STATS. */
static void test_bin_overhead_counted(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "2m", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsu_client(&s);
    /* Small records in many bins until the limit answers. */
    int stored = 0, refused = 0;
    size_t len;
    uint8_t *rec = tsu_rec_int(1, &len);
    enum { BATCH = 500 };
    for (int round = 0; round < 200 && refused == 0; round++) {
        for (int i = 0; i < BATCH; i++) {
            char name[32];
            snprintf(name, sizeof(name), "bin-%d", round * BATCH + i);
            assert_int_equal(tsu_send_store(fd, TS_OP_PUT, (uint32_t)i + 1, name, rec, len), 0);
        }
        for (int i = 0; i < BATCH; i++) {
            tsu_frame f;
            assert_int_equal(th_recv_reply(fd, (uint32_t)i + 1, &f, NULL), 0);
            if (f.h.status == TS_ST_OK) {
                stored++;
            } else {
                assert_int_equal(f.h.status, TS_ST_OUT_OF_MEMORY);
                if (refused == 0)
                    assert_true(memmem(f.body, f.len, "bin and item overhead", 21) != NULL);
                refused++;
            }
            tsu_frame_free(&f);
        }
    }
    tsu_rec_free(rec, len);
    assert_true(refused > 0);
    int64_t bytes = tsu_stat(fd, "bytes");
    int64_t overhead = tsu_stat(fd, "overhead_bytes");
    int64_t used = tsu_stat(fd, "used_memory");
    /* Each bin costs far more than its record's bytes: the limit came from the overhead. */
    assert_true(bytes < (2 << 20) / 2);
    assert_true(overhead > bytes);
    assert_true(used >= bytes + overhead);
    assert_true(used <= (2 << 20) + (64 << 10));
    close(fd);
    stop_server();
}

/* Output queued for a listener that never reads counts against --max-memory. */
static void test_queued_output_counted(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory",
                          "6m",
                          "--notify-backlog",
                          "1g",
                          "--max-output",
                          "1g",
                          "--output-soft",
                          "0",
                          NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int lis = tsu_client(&s);
    int sz = 4096;
    setsockopt(lis, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    assert_int_equal(tsu_send_name(lis, TS_OP_LISTEN, 3, "n", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(lis, &f, TS_OP_LISTEN, 3, TS_ST_OK);
    tsu_frame_free(&f);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_int(5, &len);
    int refused = 0;
    enum { BATCH = 500 };
    for (int round = 0; round < 400 && refused == 0; round++) {
        for (int i = 0; i < BATCH; i++)
            assert_int_equal(tsu_send_store(fd, TS_OP_PUT, (uint32_t)i + 1, "n", rec, len), 0);
        for (int i = 0; i < BATCH; i++) {
            assert_int_equal(th_recv_reply(fd, (uint32_t)i + 1, &f, NULL), 0);
            if (f.h.status != TS_ST_OK) {
                assert_int_equal(f.h.status, TS_ST_OUT_OF_MEMORY);
                if (refused == 0)
                    assert_true(memmem(f.body, f.len, "output buffers", 14) != NULL);
                refused++;
            }
            tsu_frame_free(&f);
        }
    }
    tsu_rec_free(rec, len);
    assert_true(refused > 0);
    assert_true(tsu_stat(fd, "output_bytes") > (2 << 20));
    /* Once the listener goes, its output is freed and writes work again. */
    close(lis);
    int64_t out = 0;
    for (int i = 0; i < 300; i++) {
        out = tsu_stat(fd, "output_bytes");
        if (out < (1 << 20))
            break;
        th_sleep_ms(10);
    }
    assert_true(out < (1 << 20));
    tsu_put_int(fd, TS_OP_PUT, "n", 1, NULL);
    close(fd);
    stop_server();
}

/*
 * A queued PEEK reply keeps the item it sends; when a PUT replaces that item meanwhile, its bytes
 * stay counted against --max-memory (orphaned_bytes) until the reply is gone.
 */
static void test_orphaned_reply_counted(void **state)
{
    (void)state;
    const char *args[] = {"--max-output", "64m", "--max-memory", "32m", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)8 << 20, 7, &len);
    tsu_store(fd, TS_OP_PUT, "big", rec, len, NULL);
    tsu_rec_free(rec, len);
    /* A reader that asks for the item and then reads nothing: the reply stays queued. */
    int rd = tsu_client(&s);
    int sz = 4096;
    setsockopt(rd, SOL_SOCKET, SO_RCVBUF, &sz, sizeof(sz));
    assert_int_equal(tsu_send_get(rd, TS_OP_PEEK, 9, "big", 1), 0);
    int64_t out = 0;
    for (int i = 0; i < 300 && out < (4 << 20); i++) {
        out = tsu_stat(fd, "output_bytes");
        if (out < (4 << 20))
            th_sleep_ms(10);
    }
    int64_t used_before = tsu_stat(fd, "used_memory");
    uint8_t *small = tsu_rec_int(1, &len);
    tsu_store(fd, TS_OP_PUT, "big", small, len, NULL);
    tsu_rec_free(small, len);
    int64_t orphaned = tsu_stat(fd, "orphaned_bytes");
    int64_t used = tsu_stat(fd, "used_memory");
    assert_true(orphaned >= (int64_t)8 << 20);
    assert_true(used >= tsu_stat(fd, "bytes") + orphaned);
    /* An upload refused meanwhile names the orphaned bytes among the parts of what is used. */
    uint8_t *over = tsu_rec_bytes((size_t)24 << 20, 8, &len);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 20, "over", over, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT, 20, TS_ST_OUT_OF_MEMORY);
    assert_true(expect_oom_parts(&f) >= (8ull << 20));
    tsu_frame_free(&f);
    tsu_rec_free(over, len);
    /* Once the reader goes, its reply and the replaced item are freed. */
    close(rd);
    for (int i = 0; i < 300 && orphaned != 0; i++) {
        orphaned = tsu_stat(fd, "orphaned_bytes");
        if (orphaned != 0)
            th_sleep_ms(10);
    }
    assert_int_equal(orphaned, 0);
    assert_true(tsu_stat(fd, "used_memory") < used_before - (7 << 20));
    close(fd);
    stop_server();
}

/*
 * An item of 4 MiB or more sits in a buffer rounded up to 2 MiB, and the rounding counts against
 * --max-memory: an upload whose record fits the limit but whose buffer does not is refused (raw
 * or compressed, PUT or APPEND), nothing is stored, and used_memory never passes the limit.
 */
static void test_buffer_rounding_counted(void **state)
{
    (void)state;
    const char *args[] = {"--max-memory", "7m", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int fd = tsu_client(&s);
    int zfd = lz4_client();
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)6 << 20, 6, &len); /* a buffer of 8 MiB */
    tsu_frame f;
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 2, "x", rec, len), 0);
    tsu_expect(fd, &f, TS_OP_PUT, 2, TS_ST_OUT_OF_MEMORY);
    (void)expect_oom_parts(&f);
    tsu_frame_free(&f);
    assert_int_equal(tsu_send_store(fd, TS_OP_APPEND, 3, "x", rec, len), 0);
    tsu_expect(fd, &f, TS_OP_APPEND, 3, TS_ST_OUT_OF_MEMORY);
    tsu_frame_free(&f);
    send_lz4_put(zfd, 4, "x", rec, len);
    tsu_expect(zfd, &f, TS_OP_PUT, 4, TS_ST_OUT_OF_MEMORY);
    (void)expect_oom_parts(&f);
    tsu_frame_free(&f);
    tsu_rec_free(rec, len);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 5, "x", 1), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, 5, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    assert_true(tsu_stat(fd, "used_memory") <= 7 << 20);
    /* A record of 5 MiB (a 6 MiB buffer) fits: stored, its rounding counted, under the limit. */
    rec = tsu_rec_bytes((size_t)5 << 20, 7, &len);
    tsu_store(fd, TS_OP_PUT, "y", rec, len, NULL);
    tsu_rec_free(rec, len);
    assert_true(tsu_stat(fd, "overhead_bytes") >= ((int64_t)1 << 20) - 64);
    assert_true(tsu_stat(fd, "used_memory") <= 7 << 20);
    close(zfd);
    close(fd);
    stop_server();
}

#define T(f) cmocka_unit_test_teardown(f, kill_leftover)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_partial_uploads_do_not_lock_out), T(test_stalled_body_is_cut),
        T(test_big_lz4_inflated_off_loop),       T(test_offloop_keeps_order),
        T(test_raw_len_checked_at_header),       T(test_header_rule_precedence),
        T(test_unauth_flood_leaves_room),        T(test_bytes_sent),
        T(test_trickling_uploads_leave_room),    T(test_bin_overhead_counted),
        T(test_queued_output_counted),           T(test_orphaned_reply_counted),
        T(test_buffer_rounding_counted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
