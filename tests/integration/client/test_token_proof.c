/*
 * The token never travels: a relay between the client and tensord on loopback records every
 * byte both ways, and the token's bytes are nowhere in the recording (plain TCP, and inside
 * TLS). Played back on a new connection, the recorded handshake is refused (the server's nonce
 * differs, so the recorded proof is worth nothing). Also the raw rules of docs/PROTOCOL.md
 * section 4: a clear token is refused unless --allow-plain-token, AUTH_CHALLENGE once and only
 * before HELLO, a proof without a challenge, a tokenless server that takes the proof flag
 * without granting it, and the server's own proof checked by the client.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "auth.h"
#include "harness.h"
#include "msg.h"
#include "test_client_util.h"
#include "tls_certs.h"

#define TOKEN       "relay-secret-7f3a9c-never-on-the-wire"
#define RELAY_CAP   ((size_t)4 << 20) /* bytes recorded each way, at most */
#define RELAY_CONNS 8                 /* connections the relay serves, at most */

static tsh_server srv;
static char token_file[300];

/* A loopback relay: accepts, connects to the target, copies both ways, records everything. */
typedef struct relay {
    int lfd;
    int port;
    int target_port;
    atomic_int stop;
    pthread_t th;
    uint8_t *c2s, *s2c;
    size_t c2s_len, s2c_len;
    pthread_mutex_t mu;
} relay;

static void record(relay *r, uint8_t *buf, size_t *len, const uint8_t *p, size_t n)
{
    pthread_mutex_lock(&r->mu);
    if (*len + n <= RELAY_CAP) {
        memcpy(buf + *len, p, n);
        *len += n;
    }
    pthread_mutex_unlock(&r->mu);
}

/* Copy from one side to the other until either closes or the relay stops. */
static void relay_pair(relay *r, int cfd, int sfd)
{
    uint8_t buf[65536];
    for (;;) {
        struct pollfd p[2] = {{.fd = cfd, .events = POLLIN}, {.fd = sfd, .events = POLLIN}};
        int k = poll(p, 2, 50);
        if (atomic_load(&r->stop))
            return;
        if (k <= 0)
            continue;
        for (int i = 0; i < 2; i++) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            ssize_t n = recv(p[i].fd, buf, sizeof(buf), 0);
            if (n <= 0)
                return;
            if (i == 0)
                record(r, r->c2s, &r->c2s_len, buf, (size_t)n);
            else
                record(r, r->s2c, &r->s2c_len, buf, (size_t)n);
            if (tsh_write_all(i == 0 ? sfd : cfd, buf, (size_t)n) != 0)
                return;
        }
    }
}

static void *relay_main(void *arg)
{
    relay *r = arg;
    for (int served = 0; served < RELAY_CONNS && !atomic_load(&r->stop);) {
        struct pollfd p = {.fd = r->lfd, .events = POLLIN};
        if (poll(&p, 1, 50) <= 0)
            continue;
        int cfd = accept(r->lfd, NULL, NULL);
        if (cfd < 0)
            continue;
        served++;
        int sfd = tsh_connect_tcp(r->target_port);
        if (sfd >= 0) {
            relay_pair(r, cfd, sfd);
            close(sfd);
        }
        close(cfd);
    }
    return NULL;
}

static void relay_start(relay *r, int target_port)
{
    memset(r, 0, sizeof(*r));
    pthread_mutex_init(&r->mu, NULL);
    r->c2s = malloc(RELAY_CAP);
    r->s2c = malloc(RELAY_CAP);
    assert_non_null(r->c2s);
    assert_non_null(r->s2c);
    r->target_port = target_port;
    r->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(r->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(r->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(r->lfd, 8), 0);
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(r->lfd, (struct sockaddr *)&a, &al), 0);
    r->port = ntohs(a.sin_port);
    assert_int_equal(pthread_create(&r->th, NULL, relay_main, r), 0);
}

static void relay_stop(relay *r)
{
    atomic_store(&r->stop, 1);
    pthread_join(r->th, NULL);
    close(r->lfd);
    free(r->c2s);
    free(r->s2c);
    pthread_mutex_destroy(&r->mu);
}

/* 1 when needle (n bytes) occurs in hay (len bytes). */
static int contains(const uint8_t *hay, size_t len, const void *needle, size_t n)
{
    for (size_t i = 0; i + n <= len; i++)
        if (memcmp(hay + i, needle, n) == 0)
            return 1;
    return 0;
}

static int case_teardown(void **state)
{
    (void)state;
    if (srv.pid > 0) {
        tsh_server_kill(&srv);
        tsh_server_cleanup(&srv);
    }
    memset(&srv, 0, sizeof(srv));
    unlink(token_file);
    return 0;
}

/* tensord with the token (and up to 6 extra flags). */
static void start_token_server(const char *const *extra)
{
    snprintf(token_file, sizeof(token_file), "/tmp/ts-proof-token-%d", (int)getpid());
    FILE *f = fopen(token_file, "w");
    assert_non_null(f);
    fputs(TOKEN "\n", f);
    fclose(f);
    const char *args[12] = {"--auth-token-file", token_file};
    int n = 2;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 10; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(tsh_server_start(&srv, args), 0);
}

/* Open a client through the relay, use it, close it; then check the recording. */
static void through_relay(relay *r, const char *scheme, const ts_client_options_t *o)
{
    char addr[96];
    snprintf(addr, sizeof(addr), "%s127.0.0.1:%d", scheme, r->port);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, addr, o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_value_t *v = ts_string_new(TOKEN, strlen(TOKEN) - 1); /* a value that is not the token */
    assert_int_equal(ts_put(c, "relayed", v, NULL), 0);
    ts_value_free(v);
    ts_client_free(c);
    /* The relay copies the last bytes and notices the close within its poll period. */
    tc_sleep_ms(200);
    pthread_mutex_lock(&r->mu);
    assert_true(r->c2s_len > 0 && r->s2c_len > 0);
    assert_false(contains(r->c2s, r->c2s_len, TOKEN, strlen(TOKEN)));
    assert_false(contains(r->s2c, r->s2c_len, TOKEN, strlen(TOKEN)));
    pthread_mutex_unlock(&r->mu);
}

static void test_token_not_on_wire(void **state)
{
    (void)state;
    start_token_server(NULL);
    relay r;
    relay_start(&r, srv.port);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    through_relay(&r, "", &o);
    /* The client spoke AUTH_CHALLENGE first, then HELLO with the proof flag. */
    pthread_mutex_lock(&r.mu);
    assert_true(r.c2s_len >= 2 * TS_HDR_SIZE + TS_MSG_AUTH_NONCE_SIZE);
    assert_int_equal(r.c2s[2], TS_OP_AUTH_CHALLENGE);
    const uint8_t *hello = r.c2s + TS_HDR_SIZE + TS_MSG_AUTH_NONCE_SIZE;
    assert_int_equal(hello[2], TS_OP_HELLO);
    assert_true(hello[TS_HDR_SIZE + 1] & TS_HELLO_TOKEN_PROOF);
    /* The recorded opening (challenge and HELLO), played back on a new connection. */
    size_t opening =
        2 * TS_HDR_SIZE + TS_MSG_AUTH_NONCE_SIZE + TS_MSG_HELLO_REQ_FIXED + TS_MSG_TOKEN_PROOF_SIZE;
    assert_true(r.c2s_len >= opening);
    uint8_t replay[256];
    memcpy(replay, r.c2s, opening);
    pthread_mutex_unlock(&r.mu);
    relay_stop(&r);

    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_write_all(fd, replay, opening), 0);
    ts__hdr h;
    uint8_t *body = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &body, &len), 0);
    assert_int_equal(h.opcode, TS_OP_AUTH_CHALLENGE);
    assert_int_equal(h.status, TS_ST_OK);
    free(body);
    assert_int_equal(tsh_recv(fd, &h, &body, &len), 0);
    assert_int_equal(h.opcode, TS_OP_HELLO);
    assert_int_equal(h.status, TS_ST_AUTH_FAILED);
    printf("replayed HELLO: %.*s\n", (int)len, (const char *)body);
    free(body);
    assert_true(tsh_wait_closed(fd, 5000));
    close(fd);
}

#ifdef TS_WITH_TLS
/* The same through TLS (the relay sees only ciphertext, and no token inside it either). */
static void test_token_not_on_wire_tls(void **state)
{
    (void)state;
    tls_certs certs;
    assert_int_equal(tls_certs_make(&certs), 0);
    const char *extra[] = {"--tls-cert", certs.server_cert, "--tls-key", certs.server_key, NULL};
    start_token_server(extra);
    relay r;
    relay_start(&r, srv.port);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    o.tls_ca_file = certs.ca;
    through_relay(&r, "tls://", &o);
    pthread_mutex_lock(&r.mu);
    assert_int_equal(r.c2s[0], 0x16); /* a TLS handshake record, not a frame */
    pthread_mutex_unlock(&r.mu);
    relay_stop(&r);
    tls_certs_remove(&certs);
}
#endif

/* The message of the last clear_hello reply. */
static char last_msg[1100];

/* HELLO with a clear token, on a fresh connection: the reply's status (its message printed). */
static uint16_t clear_hello(int port, const char *token)
{
    int fd = tsh_connect_tcp(port);
    assert_true(fd >= 0);
    uint8_t body[TS_MSG_HELLO_REQ_FIXED + 64];
    size_t tl = strlen(token);
    body[0] = TS_PROTO_VERSION;
    body[1] = 0;
    ts__put_u16le(body + 2, (uint16_t)tl);
    memcpy(body + 4, token, tl);
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, body, 4 + tl), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    if (h.status != TS_ST_OK)
        printf("clear token: %.*s\n", (int)len, (const char *)rb);
    snprintf(last_msg, sizeof(last_msg), "%.*s", (int)len, rb != NULL ? (const char *)rb : "");
    free(rb);
    close(fd);
    return h.status;
}

/* A raw handshake with the proof; returns the HELLO status, and checks the server's proof. */
static uint16_t proof_hello(int port, const char *token, int challenge_twice)
{
    int fd = tsh_connect_tcp(port);
    assert_true(fd >= 0);
    uint8_t cn[TS_MSG_AUTH_NONCE_SIZE], sn[TS_MSG_AUTH_NONCE_SIZE];
    assert_int_equal(ts__auth_nonce(cn), 0);
    assert_int_equal(tsh_send(fd, TS_OP_AUTH_CHALLENGE, 1, cn, sizeof(cn)), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    assert_int_equal(h.status, TS_ST_OK);
    assert_int_equal(len, TS_MSG_AUTH_NONCE_SIZE);
    memcpy(sn, rb, sizeof(sn));
    free(rb);
    if (challenge_twice) {
        assert_int_equal(tsh_send(fd, TS_OP_AUTH_CHALLENGE, 2, cn, sizeof(cn)), 0);
        assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
        free(rb);
        close(fd);
        return h.status;
    }
    uint8_t body[TS_MSG_HELLO_REQ_FIXED + TS_MSG_TOKEN_PROOF_SIZE];
    body[0] = TS_PROTO_VERSION;
    body[1] = TS_HELLO_TOKEN_PROOF;
    ts__put_u16le(body + 2, TS_MSG_TOKEN_PROOF_SIZE);
    ts__auth_proof(token, strlen(token), TS_AUTH_CLIENT, cn, sn, body + 4);
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 3, body, sizeof(body)), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    if (h.status == TS_ST_OK) {
        ts__msg_hello_rep rep;
        assert_int_equal(ts__msg_hello_rep_decode(rb, len, &rep), 0);
        assert_true(rep.flags & TS_HELLO_TOKEN_PROOF);
        uint8_t want[TS_MSG_TOKEN_PROOF_SIZE];
        ts__auth_proof(token, strlen(token), TS_AUTH_SERVER, cn, sn, want);
        assert_memory_equal(want, rep.proof, sizeof(want));
        /* AUTH_CHALLENGE after HELLO is refused and closes the connection. */
        assert_int_equal(tsh_send(fd, TS_OP_AUTH_CHALLENGE, 4, cn, sizeof(cn)), 0);
        free(rb);
        rb = NULL;
        ts__hdr h2;
        assert_int_equal(tsh_recv(fd, &h2, &rb, &len), 0);
        assert_int_equal(h2.status, TS_ST_BAD_REQUEST);
    }
    free(rb);
    close(fd);
    return h.status;
}

static void test_raw_rules(void **state)
{
    (void)state;
    start_token_server(NULL);
    assert_int_equal(clear_hello(srv.port, TOKEN), TS_ST_AUTH_FAILED);
    assert_non_null(strstr(last_msg, "--allow-plain-token"));
    assert_int_equal(proof_hello(srv.port, TOKEN, 0), TS_ST_OK);
    assert_int_equal(proof_hello(srv.port, "not the token", 0), TS_ST_AUTH_FAILED);
    assert_int_equal(proof_hello(srv.port, TOKEN, 1), TS_ST_BAD_REQUEST);
    /* A proof flag without AUTH_CHALLENGE first. */
    int fd = tsh_connect_tcp(srv.port);
    uint8_t body[TS_MSG_HELLO_REQ_FIXED + TS_MSG_TOKEN_PROOF_SIZE] = {TS_PROTO_VERSION,
                                                                      TS_HELLO_TOKEN_PROOF, 32};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 1, body, sizeof(body)), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    assert_int_equal(h.status, TS_ST_AUTH_FAILED);
    free(rb);
    close(fd);
    /* An AUTH_CHALLENGE body of the wrong size. */
    fd = tsh_connect_tcp(srv.port);
    assert_int_equal(tsh_send(fd, TS_OP_AUTH_CHALLENGE, 1, body, 16), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    assert_int_equal(h.status, TS_ST_BAD_REQUEST);
    free(rb);
    close(fd);
    tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    memset(&srv, 0, sizeof(srv));

    /* --allow-plain-token: clients before 0.5.0 get in with the clear token. */
    const char *allow[] = {"--allow-plain-token", NULL};
    start_token_server(allow);
    assert_int_equal(clear_hello(srv.port, TOKEN), TS_ST_OK);
    assert_int_equal(clear_hello(srv.port, "wrong"), TS_ST_AUTH_FAILED);
    assert_int_equal(proof_hello(srv.port, TOKEN, 0), TS_ST_OK);
}

/* A server without a token takes the proof flag harmlessly and grants nothing. */
static void test_tokenless_server(void **state)
{
    (void)state;
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    int fd = tsh_connect_tcp(srv.port);
    uint8_t cn[TS_MSG_AUTH_NONCE_SIZE] = {1};
    assert_int_equal(tsh_send(fd, TS_OP_AUTH_CHALLENGE, 1, cn, sizeof(cn)), 0);
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t len = 0;
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    assert_int_equal(h.status, TS_ST_OK);
    free(rb);
    uint8_t body[TS_MSG_HELLO_REQ_FIXED + TS_MSG_TOKEN_PROOF_SIZE] = {TS_PROTO_VERSION,
                                                                      TS_HELLO_TOKEN_PROOF, 32};
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 2, body, sizeof(body)), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &len), 0);
    assert_int_equal(h.status, TS_ST_OK);
    assert_int_equal(len, TS_MSG_HELLO_REP_SIZE);
    assert_int_equal(rb[1] & TS_HELLO_TOKEN_PROOF, 0);
    free(rb);
    close(fd);
}

/* Read one frame (any magic): its header into h; the body is read and dropped. 0 or -1. */
static int read_frame(int fd, ts__hdr *h)
{
    uint8_t hb[TS_HDR_SIZE], body[256];
    if (tsh_read_all(fd, hb, sizeof(hb)) != 0)
        return -1;
    h->opcode = hb[2];
    h->request_id = ts__get_u32le(hb + 8);
    h->body_len = ts__get_u64le(hb + 16);
    if (h->body_len > sizeof(body))
        return -1;
    return tsh_read_all(fd, body, (size_t)h->body_len);
}

/* A fake server that grants the proof flag with a wrong proof is refused by the client. */
static void *fake_server(void *arg)
{
    int lfd = *(int *)arg;
    int fd = accept(lfd, NULL, NULL);
    if (fd < 0)
        return NULL;
    ts__hdr h;
    if (read_frame(fd, &h) == 0) { /* AUTH_CHALLENGE */
        uint8_t frame[TS_HDR_SIZE + TS_MSG_HELLO_REP_SIZE + TS_MSG_TOKEN_PROOF_SIZE] = {0};
        uint8_t sn[TS_MSG_AUTH_NONCE_SIZE] = {7};
        ts__hdr rh = {.magic = TS_MAGIC_REP,
                      .version = TS_PROTO_VERSION,
                      .opcode = TS_OP_AUTH_CHALLENGE,
                      .request_id = h.request_id,
                      .body_len = sizeof(sn)};
        ts__hdr_encode(&rh, frame);
        memcpy(frame + TS_HDR_SIZE, sn, sizeof(sn));
        (void)tsh_write_all(fd, frame, TS_HDR_SIZE + sizeof(sn));
        if (read_frame(fd, &h) == 0) { /* HELLO */
            memset(frame, 0, sizeof(frame));
            rh.opcode = TS_OP_HELLO;
            rh.request_id = h.request_id;
            rh.body_len = TS_MSG_HELLO_REP_SIZE + TS_MSG_TOKEN_PROOF_SIZE;
            ts__hdr_encode(&rh, frame);
            uint8_t *p = frame + TS_HDR_SIZE;
            p[0] = TS_PROTO_VERSION;
            p[1] = TS_HELLO_TOKEN_PROOF;
            ts__put_u64le(p + 8, 1u << 30);
            memset(p + TS_MSG_HELLO_REP_SIZE, 0xAB, TS_MSG_TOKEN_PROOF_SIZE); /* not the proof */
            (void)tsh_write_all(fd, frame, sizeof(frame));
            (void)tsh_wait_closed(fd, 5000);
        }
    }
    close(fd);
    return NULL;
}

static void test_server_proof_checked(void **state)
{
    (void)state;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(lfd, 1), 0);
    socklen_t al = sizeof(a);
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &al), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, fake_server, &lfd), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "127.0.0.1:%d", ntohs(a.sin_port));
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    o.connect_timeout_ms = 5000;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, addr, &o);
    printf("fake server: %s: %s\n", ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, TS_EAUTH);
    assert_non_null(strstr(ts_last_error(), "proof"));
    pthread_join(th, NULL);
    close(lfd);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_token_not_on_wire, case_teardown),
#ifdef TS_WITH_TLS
        cmocka_unit_test_teardown(test_token_not_on_wire_tls, case_teardown),
#endif
        cmocka_unit_test_teardown(test_raw_rules, case_teardown),
        cmocka_unit_test_teardown(test_tokenless_server, case_teardown),
        cmocka_unit_test_teardown(test_server_proof_checked, case_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
