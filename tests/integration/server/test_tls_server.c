/*
 * tensord with --tls-cert/--tls-key, from raw sockets and a blocking OpenSSL client: garbage, a
 * record header announcing an impossible length, half a ClientHello left hanging and a plain
 * HELLO on the TLS port each get their connection closed within a bound while the daemon keeps
 * serving TLS clients; the unix socket stays plain; bad TLS flags stop tensord with status 2.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/ssl.h>

#include "msg.h"
#include "test_harden_util.h"
#include "tls_certs.h"

static tls_certs certs;
static tsh_server s;
static char errfile[400];

/* ms; the HELLO deadline of these daemons, so a hanging handshake is cut quickly */
#define HELLO_MS   "1500"
#define HELLO_MS_N 1500 /* ms; HELLO_MS as a number */

static int group_setup(void **state)
{
    (void)state;
    if (tls_certs_make(&certs) != 0)
        return -1;
    snprintf(errfile, sizeof(errfile), "%s/stderr", certs.dir);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    tls_certs_remove(&certs);
    return 0;
}

static int case_teardown(void **state)
{
    (void)state;
    if (s.pid > 0) {
        tsh_server_kill(&s);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    return 0;
}

static void start_tls(void)
{
    const char *args[] = {"--tls-cert",      certs.server_cert, "--tls-key", certs.server_key,
                          "--hello-timeout", HELLO_MS,          NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
}

/* Read exactly n bytes through ssl; 0 or -1. */
static int ssl_read_all(SSL *ssl, void *buf, size_t n)
{
    size_t got = 0;
    while (got < n) {
        int k = SSL_read(ssl, (char *)buf + got, (int)(n - got));
        if (k <= 0)
            return -1;
        got += (size_t)k;
    }
    return 0;
}

/* A frame through ssl and the reply's header; the reply's body is read and dropped. */
static int ssl_call(SSL *ssl, uint8_t op, uint32_t rid, const void *body, size_t len, ts__hdr *h)
{
    uint8_t f[TS_HDR_SIZE + 64];
    ts__hdr q = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = rid,
                 .body_len = len};
    ts__hdr_encode(&q, f);
    if (len > 0)
        memcpy(f + TS_HDR_SIZE, body, len);
    if (SSL_write(ssl, f, (int)(TS_HDR_SIZE + len)) != (int)(TS_HDR_SIZE + len))
        return -1;
    uint8_t rh[TS_HDR_SIZE], rb[256];
    if (ssl_read_all(ssl, rh, sizeof(rh)) != 0 || ts__hdr_decode(rh, TS_MAGIC_REP, h) != 0 ||
        h->body_len > sizeof(rb))
        return -1;
    return ssl_read_all(ssl, rb, (size_t)h->body_len);
}

/* A verified TLS connection to the daemon, HELLO and PING through it: the daemon serves. */
static void tls_client_works(void)
{
    SSL_CTX *ctx = SSL_CTX_new(TLS_client_method());
    assert_non_null(ctx);
    assert_int_equal(SSL_CTX_load_verify_locations(ctx, certs.ca, NULL), 1);
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER, NULL);
    int fd = tsh_connect_tcp(s.port);
    assert_true(fd >= 0);
    SSL *ssl = SSL_new(ctx);
    assert_non_null(ssl);
    assert_int_equal(X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(ssl), "127.0.0.1"), 1);
    SSL_set_fd(ssl, fd);
    assert_int_equal(SSL_connect(ssl), 1);
    uint8_t hello[TS_MSG_HELLO_REQ_FIXED] = {TS_PROTO_VERSION, 0, 0, 0};
    ts__hdr h;
    assert_int_equal(ssl_call(ssl, TS_OP_HELLO, 1, hello, sizeof(hello), &h), 0);
    assert_int_equal(h.status, TS_ST_OK);
    assert_int_equal(h.body_len, TS_MSG_HELLO_REP_SIZE);
    assert_int_equal(ssl_call(ssl, TS_OP_PING, 2, NULL, 0, &h), 0);
    assert_int_equal(h.status, TS_ST_OK);
    SSL_shutdown(ssl);
    SSL_free(ssl);
    SSL_CTX_free(ctx);
    close(fd);
}

/* Send bytes on a fresh TCP connection and expect the daemon to close it within ms. */
static void closed_after(const void *bytes, size_t n, int ms, const char *what)
{
    int fd = tsh_connect_tcp(s.port);
    assert_true(fd >= 0);
    if (n > 0)
        assert_int_equal(tsh_write_all(fd, bytes, n), 0);
    if (!tsh_wait_closed(fd, ms))
        fail_msg("%s: the connection is still open after %d ms", what, ms);
    close(fd);
    assert_true(tsh_server_alive(&s));
    tls_client_works();
}

static void test_garbage_closed(void **state)
{
    (void)state;
    start_tls();
    tls_client_works();
    /* Random bytes. */
    uint8_t junk[4096];
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < sizeof(junk); i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        junk[i] = (uint8_t)(x >> 32);
    }
    closed_after(junk, sizeof(junk), 5000, "random bytes");
    /* A handshake record header announcing 65535 bytes (over TLS's limit), then a few. */
    static const uint8_t big[] = {0x16, 0x03, 0x01, 0xff, 0xff, 0x01, 0x00, 0x00};
    closed_after(big, sizeof(big), 5000, "an oversized record");
    /* An alert record of nonsense. */
    static const uint8_t alert[] = {0x15, 0x03, 0x03, 0x00, 0x02, 0x02, 0xff};
    closed_after(alert, sizeof(alert), 5000, "a stray alert");
    /* A plain HELLO frame: not TLS at all. */
    uint8_t frame[TS_HDR_SIZE + TS_MSG_HELLO_REQ_FIXED];
    ts__hdr q = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = TS_OP_HELLO,
                 .request_id = 1,
                 .body_len = TS_MSG_HELLO_REQ_FIXED};
    ts__hdr_encode(&q, frame);
    memset(frame + TS_HDR_SIZE, 0, TS_MSG_HELLO_REQ_FIXED);
    frame[TS_HDR_SIZE] = TS_PROTO_VERSION;
    closed_after(frame, sizeof(frame), 5000, "a plain HELLO");
    /*
     * The start of a ClientHello, then silence: the HELLO deadline closes it, at the deadline
     * (checked twice a second) as on plain TCP, not after the grace a reply gets to be written.
     */
    static const uint8_t half[] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03};
    int deadline = HELLO_MS_N + 500 + 1000; /* the timeout, the check's period, a margin */
    closed_after(half, sizeof(half), deadline, "half a ClientHello");
    /* Nothing at all: the same. */
    closed_after(NULL, 0, deadline, "a silent connection");
    /* Many at once, then the daemon still serves. */
    int fds[32];
    for (int i = 0; i < 32; i++) {
        fds[i] = tsh_connect_tcp(s.port);
        assert_true(fds[i] >= 0);
        assert_int_equal(tsh_write_all(fds[i], junk + i * 64, 64), 0);
    }
    for (int i = 0; i < 32; i++) {
        assert_true(tsh_wait_closed(fds[i], 5000));
        close(fds[i]);
    }
    tls_client_works();
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
    memset(&s, 0, sizeof(s));
}

/* The unix socket stays plain while TCP speaks TLS. */
static void test_unix_stays_plain(void **state)
{
    (void)state;
    start_tls();
    int fd = tsh_connect_unix(s.unix_path);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    close(fd);
    tls_client_works();
}

/* Bad TLS flags: exit status 2 before anything listens. */
static void test_bad_tls_flags(void **state)
{
    (void)state;
    const char *only_cert[] = {"--port", "0", "--tls-cert", certs.server_cert, NULL};
    assert_int_equal(th_run_tensord(only_cert, errfile, 10000), 2);
    assert_true(th_file_contains(errfile, "--tls-key"));
    const char *missing[] = {"--port",           "0", "--tls-cert", "/nonexistent.pem", "--tls-key",
                             "/nonexistent.key", NULL};
    assert_int_equal(th_run_tensord(missing, errfile, 10000), 2);
    assert_true(th_file_contains(errfile, "--tls-cert"));
    const char *mismatch[] = {"--port",         "0", "--tls-cert", certs.server_cert, "--tls-key",
                              certs.client_key, NULL};
    assert_int_equal(th_run_tensord(mismatch, errfile, 10000), 2);
    const char *ca_only[] = {"--port", "0", "--tls-client-ca", certs.ca, NULL};
    assert_int_equal(th_run_tensord(ca_only, errfile, 10000), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_garbage_closed, case_teardown),
        cmocka_unit_test_teardown(test_unix_stays_plain, case_teardown),
        cmocka_unit_test_teardown(test_bad_tls_flags, case_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
