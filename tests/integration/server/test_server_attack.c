/*
 * Hostile and broken clients. Each case checks what tensord answers (an error reply naming the
 * problem, then the connection closed), and that a fresh client is then served correctly.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <string.h>
#include <unistd.h>

#include "test_server_util.h"

static tsh_server srv;
static int leftover_fd = -1; /* a client kept open until the server stops */

static int start(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-frame", "1m", NULL};
    return tsh_server_start(&srv, args);
}

static int stop(void **state)
{
    (void)state;
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    if (leftover_fd >= 0) {
        close(leftover_fd);
        leftover_fd = -1;
    }
    return rc == 0 ? 0 : -1;
}

/* A valid header with the given fields, for corruption. */
static void make_hdr(uint8_t out[TS_HDR_SIZE], uint8_t op, uint32_t rid, uint64_t body_len)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = rid,
                 .body_len = body_len};
    ts__hdr_encode(&h, out);
}

/* After HELLO, send a raw header (and optional body bytes), expect status and a close. */
static void send_bad_header(const uint8_t hdr[TS_HDR_SIZE], uint16_t status)
{
    int fd = tsu_client(&srv);
    assert_int_equal(tsh_write_all(fd, hdr, TS_HDR_SIZE), 0);
    tsu_expect_error_close(fd, status);
    close(fd);
    tsu_check_healthy(&srv);
}

static void test_garbage_bytes(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    uint8_t junk[64];
    for (size_t i = 0; i < sizeof(junk); i++)
        junk[i] = (uint8_t)(i * 37 + 11);
    assert_int_equal(tsh_write_all(fd, junk, sizeof(junk)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* The same after a successful HELLO. */
    fd = tsu_client(&srv);
    assert_int_equal(tsh_write_all(fd, "GET / HTTP/1.1\r\nHost: x\r\n\r\n", 27), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    tsu_check_healthy(&srv);
}

static void test_bad_header_fields(void **state)
{
    (void)state;
    uint8_t h[TS_HDR_SIZE];

    make_hdr(h, TS_OP_PING, 1, 0);
    h[0] = TS_MAGIC_REP; /* a reply's magic */
    send_bad_header(h, TS_ST_BAD_REQUEST);

    make_hdr(h, TS_OP_PING, 2, 0);
    h[1] = 2; /* version */
    send_bad_header(h, TS_ST_UNSUPPORTED_VERSION);

    make_hdr(h, TS_OP_PING, 3, 0);
    h[6] = 1; /* reserved u16 */
    send_bad_header(h, TS_ST_BAD_REQUEST);

    make_hdr(h, TS_OP_PING, 4, 0);
    h[15] = 0x80; /* reserved u32 */
    send_bad_header(h, TS_ST_BAD_REQUEST);

    make_hdr(h, TS_OP_PING, 5, 0);
    h[3] = 0x40; /* unknown flag */
    send_bad_header(h, TS_ST_BAD_REQUEST);

    make_hdr(h, TS_OP_PING, 6, 0);
    h[4] = 3; /* status in a request */
    send_bad_header(h, TS_ST_BAD_REQUEST);

    int fd = tsu_client(&srv);
    assert_true(tsu_stat(fd, "protocol_errors") >= 6);
    close(fd);
}

static void test_huge_body_length(void **state)
{
    (void)state;
    long rss0 = tsh_server_rss_kib(&srv);
    uint8_t h[TS_HDR_SIZE];
    for (uint8_t op = TS_OP_PING; op <= TS_OP_PUT; op++) {
        make_hdr(h, op, 9, (uint64_t)1 << 60);
        send_bad_header(h, TS_ST_TOO_LARGE);
    }
    make_hdr(h, TS_OP_APPEND, 9, UINT64_MAX);
    send_bad_header(h, TS_ST_TOO_LARGE);
    /* Nothing was allocated for the declared lengths. */
    long rss1 = tsh_server_rss_kib(&srv);
    if (rss0 > 0 && rss1 > 0)
        assert_true(rss1 < rss0 + 64 * 1024);
}

static void test_body_over_max_frame(void **state)
{
    (void)state;
    /* --max-frame is 1 MiB here. */
    uint8_t h[TS_HDR_SIZE];
    make_hdr(h, TS_OP_PUT, 10, (1u << 20) + 1);
    send_bad_header(h, TS_ST_TOO_LARGE);
    /* A control request larger than any valid one is refused too. */
    make_hdr(h, TS_OP_GET, 11, 100000);
    send_bad_header(h, TS_ST_TOO_LARGE);
    /* Exactly at the limit is fine. */
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes((1u << 20) - 256, 1, &len);
    assert_true(1 + 2 + len <= (1u << 20));
    tsu_store(fd, TS_OP_PUT, "at", rec, len, NULL);
    tsu_rec_free(rec, len);
    close(fd);
}

static void test_truncated_frame_then_close(void **state)
{
    (void)state;
    int fd = tsu_client(&srv);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(4000, 1, &len);
    uint8_t h[TS_HDR_SIZE];
    make_hdr(h, TS_OP_PUT, 1, 1 + 1 + len);
    assert_int_equal(tsh_write_all(fd, h, sizeof(h)), 0);
    assert_int_equal(tsh_write_all(fd, "\x01t", 2), 0);
    assert_int_equal(tsh_write_all(fd, rec, len / 2), 0);
    close(fd);
    tsu_rec_free(rec, len);
    tsu_check_healthy(&srv);
    fd = tsu_client(&srv);
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    close(fd);
}

static void test_frame_before_hello(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 1, NULL, 0), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A put before HELLO creates nothing. */
    fd = tsh_connect_tcp(srv.port);
    size_t len;
    uint8_t *rec = tsu_rec_int(1, &len);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 2, "early", rec, len), 0);
    tsu_rec_free(rec, len);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    tsu_check_healthy(&srv);
    fd = tsu_client(&srv);
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    close(fd);
}

static void test_oversized_prehello_body(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    uint8_t h[TS_HDR_SIZE];
    make_hdr(h, TS_OP_HELLO, 1, TS_MAX_PREAUTH_BODY + 1);
    assert_int_equal(tsh_write_all(fd, h, sizeof(h)), 0);
    tsu_expect_error_close(fd, TS_ST_TOO_LARGE);
    close(fd);
    tsu_check_healthy(&srv);
}

static void test_bad_hello_and_duplicate(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    uint8_t body[4] = {1, 0, 9, 0}; /* token_len 9, no token bytes */
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, body, sizeof(body)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    fd = tsu_client(&srv);
    uint8_t ok[4] = {1, 0, 0, 0};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 2, ok, sizeof(ok)), 0);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    tsu_check_healthy(&srv);
}

static void test_unknown_opcode(void **state)
{
    (void)state;
    uint8_t h[TS_HDR_SIZE];
    make_hdr(h, 0x55, 1, 0);
    send_bad_header(h, TS_ST_UNKNOWN_OPCODE);
    make_hdr(h, TS_OP_NOTIFY, 2, 0); /* server-to-client only */
    send_bad_header(h, TS_ST_UNKNOWN_OPCODE);
    make_hdr(h, 0, 3, 0);
    send_bad_header(h, TS_ST_UNKNOWN_OPCODE);
    /* An unknown opcode with a large body: refused without reading the body. */
    make_hdr(h, 0xEE, 4, 500000);
    send_bad_header(h, TS_ST_UNKNOWN_OPCODE);
}

static void test_malformed_bodies(void **state)
{
    (void)state;
    struct {
        uint8_t op;
        uint8_t body[8];
        size_t len;
    } cases[] = {
        {TS_OP_GET, {3, 'a', 'b'}, 3},            /* name longer than the body */
        {TS_OP_GET, {1, 'a', 0, 0}, 4},           /* max_items cut short */
        {TS_OP_PEEK, {1, 'a', 0, 0, 0, 0, 9}, 7}, /* trailing byte */
        {TS_OP_DELETE, {0}, 0},                   /* no name at all */
        {TS_OP_WAIT, {1, 'a', 1, 2, 3}, 5},       /* after_version cut short */
        {TS_OP_PING, {1}, 1},                     /* PING takes no body */
        {TS_OP_PUT, {0}, 0},                      /* PUT without a name */
        {TS_OP_APPEND, {5, 'a'}, 2},              /* name longer than the body */
    };
    for (size_t i = 0; i < TS__ARRAY_SIZE(cases); i++) {
        int fd = tsu_client(&srv);
        assert_int_equal(tsh_send(fd, cases[i].op, 40 + (uint32_t)i, cases[i].body, cases[i].len),
                         0);
        tsu_frame f;
        tsu_expect(fd, &f, cases[i].op, 40 + (uint32_t)i, TS_ST_BAD_REQUEST);
        tsu_frame_free(&f);
        assert_int_equal(tsh_wait_closed(fd, 5000), 1);
        close(fd);
    }
    tsu_check_healthy(&srv);
}

/* PUT a broken record: BAD_RECORD, close, and the bin is not created. */
static void put_bad_record(const uint8_t *rec, size_t len)
{
    int fd = tsu_client(&srv);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 77, "bad", rec, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT, 77, TS_ST_BAD_RECORD);
    assert_true(f.len > 0);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
    fd = tsu_client(&srv);
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 1, "bad", 0), 0);
    tsu_expect(fd, &f, TS_OP_PEEK, 1, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    close(fd);
}

static void test_bad_records(void **state)
{
    (void)state;
    size_t len;
    uint64_t dims[9] = {2, 2, 1, 1, 1, 1, 1, 1, 1};

    /* The valid baseline is accepted. */
    uint8_t *rec = tsu_rec_tensor_raw(TS_FLOAT32, 2, dims, 0, 16, 16, &len);
    int fd = tsu_client(&srv);
    tsu_store(fd, TS_OP_PUT, "good", rec, len, NULL);
    close(fd);

    rec[0] = 'X'; /* bad magic */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    rec = tsu_rec_tensor_raw(TS_FLOAT32, 9, dims, 0, 16, 16, &len); /* ndim 9 */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    rec = tsu_rec_tensor_raw(TS_FLOAT32, 2, dims, 0, 12, 16, &len); /* shape x dtype != len */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    rec = tsu_rec_tensor_raw(TS_FLOAT32, 2, dims, 8, 16, 64, &len); /* misaligned offset */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    rec = tsu_rec_tensor_raw(99, 2, dims, 0, 16, 16, &len); /* unknown dtype */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    rec = tsu_rec_tensor_raw(TS_FLOAT32, 2, dims, 0, 16, 16, &len);
    ts__put_u64le(rec + 8, 1000); /* data_len disagrees with the record length */
    put_bad_record(rec, len);
    tsu_rec_free(rec, len);

    uint8_t tiny[8] = {'T', 'S', 'R', 1, 0, 0, 0, 0}; /* shorter than a record header */
    put_bad_record(tiny, sizeof(tiny));

    tsu_check_healthy(&srv);
}

static void test_idle_and_half_header_clients(void **state)
{
    (void)state;
    /* One client connects and says nothing; one sends half a header and goes silent. */
    int idle = tsh_connect_tcp(srv.port);
    assert_true(idle >= 0);
    int half = tsu_client(&srv);
    uint8_t h[TS_HDR_SIZE];
    make_hdr(h, TS_OP_PING, 1, 0);
    assert_int_equal(tsh_write_all(half, h, 10), 0);
    /* Meanwhile others work normally. */
    for (int i = 0; i < 5; i++)
        tsu_check_healthy(&srv);
    int fd = tsu_client(&srv);
    assert_int_equal(tsu_stat(fd, "connections"), 3);
    close(fd);
    /* The rest of the half header arrives late and is answered. */
    assert_int_equal(tsh_write_all(half, h + 10, TS_HDR_SIZE - 10), 0);
    tsu_frame f;
    tsu_expect(half, &f, TS_OP_PING, 1, TS_ST_OK);
    /* The silent ones do not hold up shutdown (stop() checks the clean exit). */
    close(half);
    leftover_fd = idle;
}

static void test_disconnect_mid_body(void **state)
{
    (void)state;
    for (int round = 0; round < 3; round++) {
        int fd = tsu_client(&srv);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(900 << 10, 5, &len);
        uint8_t h[TS_HDR_SIZE];
        make_hdr(h, round == 1 ? TS_OP_APPEND : TS_OP_PUT, 1, 1 + 4 + len);
        assert_int_equal(tsh_write_all(fd, h, sizeof(h)), 0);
        assert_int_equal(tsh_write_all(fd, "\x04mid!", 5), 0);
        assert_int_equal(tsh_write_all(fd, rec, len / 3), 0);
        if (round == 2)
            usleep(50000); /* let the server start reading straight into the item */
        close(fd);
        tsu_rec_free(rec, len);
    }
    tsu_check_healthy(&srv);
    int fd = tsu_client(&srv);
    for (int i = 0; i < 200 && tsu_stat(fd, "bytes_reserved") != 0; i++)
        usleep(10000);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    assert_int_equal(tsu_stat(fd, "bins"), 0);
    close(fd);
}

/*
 * A compressed upload whose body is far longer than any LZ4 block of its raw length could be:
 * the compressed buffer would be allocated at the body's size while only the small raw length is
 * reserved, so a few such clients could hold far more than --max-memory. It is refused as
 * malformed as soon as the raw length is known, before the rest of the body is sent.
 */
static void test_lz4_body_longer_than_bound(void **state)
{
    (void)state;
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    uint8_t hello[4] = {1, TS_HELLO_LZ4, 0, 0};
    tsu_frame f;
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, hello, sizeof(hello)), 0);
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    assert_int_equal(f.body[1], TS_HELLO_LZ4);
    tsu_frame_free(&f);
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_PUT,
                 .flags = TS_FLAG_LZ4,
                 .request_id = 2,
                 .body_len = 1000 << 10};
    uint8_t frame[TS_HDR_SIZE + 8];
    ts__hdr_encode(&h, frame);
    ts__put_u64le(frame + TS_HDR_SIZE, 64);
    assert_int_equal(tsh_write_all(fd, frame, sizeof(frame)), 0);
    tsu_expect(fd, &f, TS_OP_PUT, 2, TS_ST_BAD_REQUEST);
    tsu_frame_free(&f);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
    tsu_check_healthy(&srv);
    fd = tsu_client(&srv);
    assert_int_equal(tsu_stat(fd, "bytes_reserved"), 0);
    close(fd);
}

#define T(f) cmocka_unit_test_setup_teardown(f, start, stop)

int main(void)
{
    const struct CMUnitTest tests[] = {
        T(test_garbage_bytes),
        T(test_bad_header_fields),
        T(test_huge_body_length),
        T(test_body_over_max_frame),
        T(test_truncated_frame_then_close),
        T(test_frame_before_hello),
        T(test_oversized_prehello_body),
        T(test_bad_hello_and_duplicate),
        T(test_unknown_opcode),
        T(test_malformed_bodies),
        T(test_bad_records),
        T(test_idle_and_half_header_clients),
        T(test_disconnect_mid_body),
        T(test_lz4_body_longer_than_bound),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
