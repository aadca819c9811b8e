/*
 * 50 connections send random and half-valid bytes to tensord for TS_HARDEN_FUZZ_SECONDS (30 s
 * by default, 10 s in sanitizer builds) while a well-behaved client checks every answer it
 * gets. The daemon must stay up, its memory bounded, and the good client must see no error.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "record.h"
#include "test_harden_util.h"

#define NFUZZ   50
#define OUT_CAP (64 * 1024)

static tsh_server s;

static int kill_leftover(void **state)
{
    (void)state;
    if (s.pid > 0) {
        tsh_server_kill(&s);
        tsh_server_cleanup(&s);
    }
    return 0;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;

static uint64_t rnd(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint32_t below(uint32_t n)
{
    return (uint32_t)(rnd() % n);
}

typedef struct fuzzer {
    int fd;
    int mode;      /* 0 random bytes, 1 random frames, 2 mutated requests, 3 lz4 frames */
    size_t budget; /* bytes to send before reconnecting */
    uint8_t out[OUT_CAP];
    size_t out_len, out_off;
} fuzzer;

static fuzzer fz[NFUZZ];
static uint64_t st_bytes, st_conns, st_frames, st_closed_by_server;
static uint8_t *valid_rec;
static size_t valid_len;

static void put_hdr(uint8_t *p, uint8_t op, uint8_t flags, uint64_t len)
{
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = flags,
                 .request_id = (uint32_t)rnd(),
                 .body_len = len};
    ts__hdr_encode(&h, p);
}

/* Append the next piece of input for f's mode to its output buffer. */
static void generate(fuzzer *f)
{
    uint8_t *p = f->out + f->out_len;
    size_t room = OUT_CAP - f->out_len;
    if (room < 4096)
        return;
    if (f->mode == 0) {
        size_t n = 1 + below(2048);
        for (size_t i = 0; i < n; i++)
            p[i] = (uint8_t)rnd();
        f->out_len += n;
        return;
    }
    st_frames++;
    if (f->mode == 1 || f->mode == 3) {
        /* A header that passes the magic and version checks, with anything after it. */
        uint8_t op = below(8) == 0 ? (uint8_t)rnd() : (uint8_t)(1 + below(13));
        uint8_t flags = f->mode == 3 ? TS_FLAG_LZ4 : (below(16) == 0 ? (uint8_t)rnd() : 0);
        size_t n = below(1500);
        uint64_t len = below(32) == 0 ? rnd() : n;
        put_hdr(p, op, flags, len);
        if (below(32) == 0)
            p[below(TS_HDR_SIZE)] ^= (uint8_t)(1u << below(8));
        for (size_t i = 0; i < n; i++)
            p[TS_HDR_SIZE + i] = (uint8_t)rnd();
        if (f->mode == 3 && n >= 8)
            ts__put_u64le(p + TS_HDR_SIZE, below(1 << 20));
        f->out_len += TS_HDR_SIZE + n;
        return;
    }
    /* A real request on one of ten bins, its body sometimes mutated. */
    static const uint8_t ops[] = {TS_OP_PUT,    TS_OP_APPEND, TS_OP_GET,    TS_OP_PEEK,
                                  TS_OP_LIST,   TS_OP_WAIT,   TS_OP_LISTEN, TS_OP_UNLISTEN,
                                  TS_OP_DELETE, TS_OP_PING,   TS_OP_STATS};
    uint8_t op = ops[below(TS__ARRAY_SIZE(ops))];
    uint8_t body[2048];
    size_t n = 0;
    char name[8];
    snprintf(name, sizeof(name), "f%u", below(10));
    size_t nl = strlen(name);
    if (op != TS_OP_LIST && op != TS_OP_PING && op != TS_OP_STATS) {
        body[n++] = (uint8_t)nl;
        memcpy(body + n, name, nl);
        n += nl;
    }
    if (op == TS_OP_PUT || op == TS_OP_APPEND) {
        memcpy(body + n, valid_rec, valid_len);
        n += valid_len;
    } else if (op == TS_OP_GET || op == TS_OP_PEEK) {
        ts__put_u32le(body + n, below(3));
        n += 4;
    } else if (op == TS_OP_WAIT) {
        ts__put_u64le(body + n, rnd());
        ts__put_u32le(body + n + 8, below(200));
        n += 12;
    }
    int flips = below(4) == 0 ? (int)below(6) : 0;
    for (int i = 0; i < flips && n > 0; i++)
        body[below((uint32_t)n)] ^= (uint8_t)(1u << below(8));
    if (below(16) == 0 && n > 0)
        n = below((uint32_t)n); /* cut short */
    put_hdr(p, op, 0, n);
    memcpy(p + TS_HDR_SIZE, body, n);
    f->out_len += TS_HDR_SIZE + n;
}

static void fuzzer_connect(fuzzer *f)
{
    f->fd = tsh_connect_tcp(s.port);
    assert_true(f->fd >= 0);
    assert_int_equal(fcntl(f->fd, F_SETFL, fcntl(f->fd, F_GETFL) | O_NONBLOCK), 0);
    f->mode = (int)below(4);
    f->budget = 1 + below(256 * 1024);
    f->out_len = f->out_off = 0;
    st_conns++;
    if (f->mode != 0) {
        /* A proper HELLO first (lz4 negotiated in mode 3). */
        uint8_t *p = f->out;
        put_hdr(p, TS_OP_HELLO, 0, 4);
        p[TS_HDR_SIZE] = TS_PROTO_VERSION;
        p[TS_HDR_SIZE + 1] = f->mode == 3 ? TS_HELLO_LZ4 : 0;
        p[TS_HDR_SIZE + 2] = p[TS_HDR_SIZE + 3] = 0;
        f->out_len = TS_HDR_SIZE + 4;
    }
}

/* One round for one fuzzer: send what the socket takes, read and drop, reconnect when done. */
static void fuzzer_step(fuzzer *f)
{
    generate(f);
    while (f->out_off < f->out_len) {
        ssize_t k = send(f->fd, f->out + f->out_off, f->out_len - f->out_off, MSG_NOSIGNAL);
        if (k <= 0)
            break;
        f->out_off += (size_t)k;
        st_bytes += (uint64_t)k;
        f->budget = (size_t)k >= f->budget ? 0 : f->budget - (size_t)k;
    }
    if (f->out_off == f->out_len)
        f->out_off = f->out_len = 0;
    int gone = 0;
    uint8_t buf[65536];
    for (int i = 0; i < 16; i++) {
        ssize_t k = recv(f->fd, buf, sizeof(buf), 0);
        if (k > 0)
            continue;
        if (k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
            gone = 1;
        break;
    }
    if (gone || f->budget == 0) {
        st_closed_by_server += gone;
        close(f->fd);
        fuzzer_connect(f);
    }
}

/* The well-behaved client: every answer is checked exactly. */
static void good_round(int fd, int64_t i)
{
    char name[32];
    snprintf(name, sizeof(name), "good/%lld", (long long)(i % 7));
    uint64_t v = tsu_put_int(fd, TS_OP_PUT, name, i, NULL);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, name, 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.version, v);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), i);
    tsu_frame_free(&it.f);
    uint32_t n;
    tsu_put_int(fd, TS_OP_APPEND, "good/queue", i, &n);
    if (n >= 5) {
        tsu_get(fd, TS_OP_GET, "good/queue", 0, &it);
        assert_int_equal(it.n, n);
        assert_int_equal(tsu_item_int(it.item[n - 1], it.item_len[n - 1]), i);
        tsu_frame_free(&it.f);
    }
}

static void test_random_bytes(void **state)
{
    (void)state;
    const char *secs_env = getenv("TS_HARDEN_FUZZ_SECONDS");
    long secs = secs_env != NULL ? strtol(secs_env, NULL, 10) : 30;
    if (secs <= 0)
        secs = 30;
    const char *args[] = {
        "--max-frame", "1m", "--max-memory", "64m", "--max-output", "8m", "--hello-timeout",
        "2000",        NULL};
    th_small_asan_quarantine();
    assert_int_equal(tsh_server_start(&s, args), 0);
    valid_rec = tsu_rec_bytes(300, 1, &valid_len);
    int good = tsu_client(&s);
    long rss0 = tsh_server_rss_kib(&s), rss_max = rss0;
    for (int i = 0; i < NFUZZ; i++)
        fuzzer_connect(&fz[i]);
    uint64_t end = th_now_ms() + (uint64_t)secs * 1000u, next_sample = 0;
    int64_t rounds = 0;
    while (th_now_ms() < end) {
        for (int i = 0; i < NFUZZ; i++)
            fuzzer_step(&fz[i]);
        good_round(good, rounds++);
        if (th_now_ms() >= next_sample) {
            assert_true(tsh_server_alive(&s));
            long r = tsh_server_rss_kib(&s);
            if (r > rss_max)
                rss_max = r;
            next_sample = th_now_ms() + 500;
        }
    }
    for (int i = 0; i < NFUZZ; i++)
        close(fz[i].fd);
    int64_t perr = tsu_stat(good, "protocol_errors");
    close(good);
    print_message("random input: %lld s, %llu bytes on %llu connections (%llu frames), %llu "
                  "connections closed by tensord, %lld protocol errors answered; the good client "
                  "made %lld checked rounds without an error; RSS %ld -> max %ld KiB\n",
                  (long long)secs, (unsigned long long)st_bytes, (unsigned long long)st_conns,
                  (unsigned long long)st_frames, (unsigned long long)st_closed_by_server,
                  (long long)perr, (long long)rounds, rss0, rss_max);
    assert_true(st_conns > NFUZZ);
    assert_true(perr > 0);
    /* Bounded by --max-memory (64 MiB) plus connection buffers, whatever was sent. */
    assert_true(rss_max - rss0 < 160 * 1024);
    tsu_rec_free(valid_rec, valid_len);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_random_bytes, kill_leftover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
