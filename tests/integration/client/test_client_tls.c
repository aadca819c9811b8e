/*
 * The client over TLS against a real tensord with --tls-cert/--tls-key (certificates made at
 * test time, tests/support/tls_certs.h): small and large puts and gets, many threads on one TLS
 * connection, a reconnect after a restart (a new handshake), the CA from TS_TLS_CA, a server
 * certificate from another CA or for another name (TS_EAUTH at ts_client_open), client
 * certificates required (missing: refused; present: served), a plain client on the TLS port and
 * a TLS client on a plain port (both fail, neither hangs), the unix socket staying plain, the
 * token proof inside TLS, and a cluster client of two TLS shards (a list and a map file), which
 * takes every TLS option and check a single client does.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <unistd.h>

#include "cluster.h"
#include "harness.h"
#include "test_client_util.h"
#include "tls_certs.h"

static tls_certs certs;
static tsh_server srv;
static char tls_addr[96];

#define BIG_FLOATS ((int64_t)4 << 20) /* 16 MiB of float32: many TLS records and chunks */
#define N_THREADS  4
#define PER_THREAD 50

static int group_setup(void **state)
{
    (void)state;
    return tls_certs_make(&certs);
}

static int group_teardown(void **state)
{
    (void)state;
    tls_certs_remove(&certs);
    return 0;
}

static tsc_cluster shards; /* the cluster tests' daemons (--shard i/2) */

static int case_teardown(void **state)
{
    (void)state;
    if (srv.pid > 0) {
        tsh_server_kill(&srv);
        tsh_server_cleanup(&srv);
    }
    memset(&srv, 0, sizeof(srv));
    if (shards.n > 0)
        tsc_stop(&shards);
    memset(&shards, 0, sizeof(shards));
    unsetenv("TS_TLS_CA");
    return 0;
}

/* tensord with TLS (and extra flags, at most 6). */
static void start_tls_server(const char *const *extra)
{
    const char *args[16] = {"--tls-cert", certs.server_cert, "--tls-key", certs.server_key};
    int n = 4;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 14; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(tsh_server_start(&srv, args), 0);
    snprintf(tls_addr, sizeof(tls_addr), "tls://127.0.0.1:%d", srv.port);
}

static void tls_opts(ts_client_options_t *o)
{
    ts_client_options_init(o);
    o->tls_ca_file = certs.ca;
    o->connect_timeout_ms = 5000;
}

static ts_value_t *int_value(int64_t v)
{
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "v", ts_int_new(v)), 0);
    return m;
}

static int64_t item_int(const ts_items_t *items, size_t i)
{
    const ts_value_t *v = ts_map_get(ts_items_at(items, i), "v");
    assert_non_null(v);
    int64_t n = 0;
    assert_int_equal(ts_value_int(v, &n), 0);
    return n;
}

/* A put and a get of a small record and of a 16 MiB tensor. */
static void put_get_roundtrip(ts_client_t *c, const char *prefix)
{
    char small[64], big[64];
    snprintf(small, sizeof(small), "%s-small", prefix);
    snprintf(big, sizeof(big), "%s-big", prefix);
    ts_value_t *v = int_value(42);
    assert_int_equal(ts_put(c, small, v, NULL), 0);
    ts_value_free(v);
    ts_items_t *items = NULL;
    assert_int_equal(ts_get(c, small, 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(item_int(items, 0), 42);
    ts_items_free(items);

    int64_t shape[1] = {BIG_FLOATS};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    assert_non_null(t);
    float *f = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < BIG_FLOATS; i++)
        f[i] = (float)(i % 9973);
    assert_int_equal(ts_put(c, big, t, NULL), 0);
    ts_value_free(t);
    assert_int_equal(ts_get(c, big, 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    const ts_tensor_t *got = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(got);
    assert_int_equal(got->shape[0], BIG_FLOATS);
    const float *g = got->data;
    for (int64_t i = 0; i < BIG_FLOATS; i += 4093)
        assert_true(g[i] == (float)(i % 9973));
    assert_true(g[BIG_FLOATS - 1] == (float)((BIG_FLOATS - 1) % 9973));
    ts_items_free(items);
}

static void test_tls_put_get(void **state)
{
    (void)state;
    start_tls_server(NULL);
    ts_client_options_t o;
    tls_opts(&o);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    put_get_roundtrip(c, "a");
    ts_client_free(c);

    /* The name "localhost" is in the certificate too; the tls option turns TLS on as well. */
    char plain_addr[64];
    snprintf(plain_addr, sizeof(plain_addr), "127.0.0.1:%d", srv.port);
    o.tls = 1;
    o.tls_server_name = "localhost";
    assert_int_equal(ts_client_open(&c, plain_addr, &o), 0);
    put_get_roundtrip(c, "b");
    ts_client_free(c);

    /* The unix socket stays plain. */
    ts_client_options_init(&o);
    assert_int_equal(ts_client_open(&c, srv.unix_addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
}

typedef struct worker {
    ts_client_t *c;
    int id;
    int failures;
} worker;

static void *worker_main(void *arg)
{
    worker *w = arg;
    char bin[32];
    snprintf(bin, sizeof(bin), "w%d", w->id);
    for (int i = 0; i < PER_THREAD; i++) {
        ts_value_t *v = int_value(i);
        if (ts_append(w->c, bin, v, NULL) != 0)
            w->failures++;
        ts_value_free(v);
    }
    ts_items_t *items = NULL;
    if (ts_get(w->c, bin, 0, &items) != 0 || ts_items_count(items) != PER_THREAD)
        w->failures++;
    ts_items_free(items);
    return NULL;
}

/* Threads share one TLS connection; then a restart: the reconnect makes a new handshake. */
static void test_tls_threads_reconnect(void **state)
{
    (void)state;
    start_tls_server(NULL);
    ts_client_options_t o;
    tls_opts(&o);
    o.reconnect_max_ms = 200;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    pthread_t th[N_THREADS];
    worker w[N_THREADS];
    for (int i = 0; i < N_THREADS; i++) {
        w[i] = (worker){.c = c, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, worker_main, &w[i]), 0);
    }
    for (int i = 0; i < N_THREADS; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(w[i].failures, 0);
    }
    tsh_server_kill(&srv);
    const char *args[] = {"--tls-cert", certs.server_cert, "--tls-key", certs.server_key, NULL};
    assert_int_equal(tsh_server_restart(&srv, args), 0);
    int rc = -1;
    for (uint64_t t0 = tc_now_ms(); rc != 0 && tc_now_ms() - t0 < TC_WAIT_MS; tc_sleep_ms(50))
        rc = ts_ping(c);
    assert_int_equal(rc, 0);
    put_get_roundtrip(c, "after-restart");
    ts_client_free(c);
}

/*
 * A restart with a certificate the client cannot verify (the other CA's own, self-signed): a
 * request waiting for the reconnection fails at once with TS_EAUTH, the address in front of the
 * reason, long before its deadline.
 */
static void test_tls_reconnect_verification(void **state)
{
    (void)state;
    start_tls_server(NULL);
    ts_client_options_t o;
    tls_opts(&o);
    o.reconnect_max_ms = 200;
    o.request_timeout_ms = 20000;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    tsh_server_kill(&srv);
    char other_key[320];
    snprintf(other_key, sizeof(other_key), "%s/other-ca.key", certs.dir);
    const char *args[] = {"--tls-cert", certs.other_ca, "--tls-key", other_key, NULL};
    assert_int_equal(tsh_server_restart(&srv, args), 0);
    for (uint64_t t0 = tc_now_ms(); ts_client_connected(c) && tc_now_ms() - t0 < TC_WAIT_MS;)
        tc_sleep_ms(10);
    ts_value_t *v = int_value(1);
    uint64_t t0 = tc_now_ms();
    int rc = ts_put(c, "after-bad-restart", v, NULL);
    uint64_t ms = tc_now_ms() - t0;
    ts_value_free(v);
    printf("waiting request, bad certificate: %s: %s (%llu ms)\n", ts_err_name(rc), ts_last_error(),
           (unsigned long long)ms);
    assert_int_equal(rc, TS_EAUTH);
    assert_true(ms < 10000);
    char want[160];
    snprintf(want, sizeof(want), "%s: TLS: ", tls_addr);
    assert_true(strncmp(ts_last_error(), want, strlen(want)) == 0);
    assert_non_null(strstr(ts_last_error(), "certificate verification failed"));
    ts_client_free(c);
}

/* A certificate the client cannot verify fails ts_client_open with TS_EAUTH and says why. */
static void test_tls_verification(void **state)
{
    (void)state;
    start_tls_server(NULL);
    ts_client_options_t o;
    tls_opts(&o);
    o.tls_ca_file = certs.other_ca;
    ts_client_t *c = NULL;
    int rc = ts_client_open(&c, tls_addr, &o);
    printf("other CA: %s: %s\n", ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, TS_EAUTH);
    assert_non_null(strstr(ts_last_error(), "certificate verification failed"));

    tls_opts(&o);
    o.tls_server_name = "not-the-server.example";
    rc = ts_client_open(&c, tls_addr, &o);
    printf("other name: %s: %s\n", ts_err_name(rc), ts_last_error());
    assert_int_equal(rc, TS_EAUTH);

    /* TS_TLS_CA is taken when the option is NULL. */
    tls_opts(&o);
    o.tls_ca_file = NULL;
    setenv("TS_TLS_CA", certs.ca, 1);
    rc = ts_client_open(&c, tls_addr, &o);
    unsetenv("TS_TLS_CA");
    assert_int_equal(rc, 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);

    /* A CA file that does not exist is an error of the options, with the system's reason. */
    tls_opts(&o);
    o.tls_ca_file = "/nonexistent/ca.pem";
    assert_int_equal(ts_client_open(&c, tls_addr, &o), TS_EINVAL);
    printf("missing CA file: %s\n", ts_last_error());
    assert_string_equal(ts_last_error(),
                        "TLS CA file /nonexistent/ca.pem: No such file or directory");
    /* So does a client certificate that does not exist. */
    tls_opts(&o);
    o.tls_cert_file = "/nonexistent/client.pem";
    o.tls_key_file = certs.client_key;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), TS_EINVAL);
    assert_string_equal(ts_last_error(),
                        "tls_cert_file /nonexistent/client.pem: No such file or directory");
    /* TLS on a unix socket is refused. */
    tls_opts(&o);
    o.tls = 1;
    assert_int_equal(ts_client_open(&c, srv.unix_addr, &o), TS_EINVAL);
}

/* --tls-client-ca: a client without a certificate is refused, one with it is served. */
static void test_tls_client_cert(void **state)
{
    (void)state;
    const char *extra[] = {"--tls-client-ca", certs.ca, NULL};
    start_tls_server(extra);
    ts_client_options_t o;
    tls_opts(&o);
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    int rc = ts_client_open(&c, tls_addr, &o);
    printf("no client certificate: %s: %s (%llu ms)\n", ts_err_name(rc), ts_last_error(),
           (unsigned long long)(tc_now_ms() - t0));
    assert_int_not_equal(rc, 0);
    assert_non_null(strstr(ts_last_error(), "TLS"));

    o.tls_cert_file = certs.client_cert;
    o.tls_key_file = certs.client_key;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    put_get_roundtrip(c, "cert");
    ts_client_free(c);
}

/* A plain client on the TLS port and a TLS client on a plain port fail; neither hangs. */
static void test_tls_mismatch(void **state)
{
    (void)state;
    start_tls_server(NULL);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 20000; /* longer than the test allows: the failure must come first */
    char plain_addr[64];
    snprintf(plain_addr, sizeof(plain_addr), "127.0.0.1:%d", srv.port);
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    int rc = ts_client_open(&c, plain_addr, &o);
    uint64_t ms = tc_now_ms() - t0;
    printf("plain client on the TLS port: %s: %s (%llu ms)\n", ts_err_name(rc), ts_last_error(),
           (unsigned long long)ms);
    assert_int_not_equal(rc, 0);
    assert_true(ms < 15000);
    /* The server is fine. */
    tls_opts(&o);
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    memset(&srv, 0, sizeof(srv));

    /* A TLS client on a plain tensord. */
    assert_int_equal(tsh_server_start(&srv, NULL), 0);
    char addr[64];
    snprintf(addr, sizeof(addr), "tls://127.0.0.1:%d", srv.port);
    tls_opts(&o);
    o.connect_timeout_ms = 20000;
    t0 = tc_now_ms();
    rc = ts_client_open(&c, addr, &o);
    ms = tc_now_ms() - t0;
    printf("TLS client on a plain port: %s: %s (%llu ms)\n", ts_err_name(rc), ts_last_error(),
           (unsigned long long)ms);
    assert_int_not_equal(rc, 0);
    assert_true(ms < 15000);
    ts_client_options_init(&o);
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
}

/* A token over TLS: the proof (the token itself is never sent, even encrypted). */
static void test_tls_token(void **state)
{
    (void)state;
    char tok[400];
    snprintf(tok, sizeof(tok), "%s/token", certs.dir);
    FILE *f = fopen(tok, "w");
    assert_non_null(f);
    fputs("tls-and-a-token\n", f);
    fclose(f);
    const char *extra[] = {"--auth-token-file", tok, NULL};
    start_tls_server(extra);
    ts_client_options_t o;
    tls_opts(&o);
    o.auth_token = "tls-and-a-token";
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, tls_addr, &o), 0);
    put_get_roundtrip(c, "token");
    ts_client_free(c);
    o.auth_token = "a-wrong-one";
    assert_int_equal(ts_client_open(&c, tls_addr, &o), TS_EAUTH);
    unlink(tok);
}

/* ---------------------------------------------------------------------------------------------
 * A cluster of TLS shards: every TLS option reaches every shard client
 */

/* bytes; "tls://127.0.0.1:65535," twice and a NUL, and more */
#define LIST_CAP 160

/* Two TLS shards (--shard i/2, plus extra); list gets "tls://A,tls://B", plain "A,B". */
static void start_tls_shards(const char *const *extra, char *list, char *plain_list)
{
    const char *args[12] = {"--tls-cert", certs.server_cert, "--tls-key", certs.server_key};
    int n = 4;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 11; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(tsc_start(&shards, 2, args), 0);
    snprintf(list, LIST_CAP, "tls://%.24s,tls://%.24s", shards.srv[0].addr, shards.srv[1].addr);
    snprintf(plain_list, LIST_CAP, "%.140s", shards.list);
}

/* Puts and gets of names on both shards, each checked on its own shard. */
static void cluster_roundtrip(ts_client_t *c, const char *prefix)
{
    for (int s = 0; s < 2; s++) {
        char name[64];
        assert_int_equal(tsc_name_for(name, sizeof(name), prefix, 0, s, 2), 0);
        ts_value_t *v = int_value(100 + s);
        assert_int_equal(ts_put(c, name, v, NULL), 0);
        ts_value_free(v);
        ts_items_t *items = NULL;
        assert_int_equal(ts_peek(c, name, 0, &items), 0);
        assert_int_equal(ts_items_count(items), 1);
        assert_int_equal(item_int(items, 0), 100 + s);
        ts_items_free(items);
    }
    assert_int_equal(ts_ping(c), 0); /* every shard */
}

static int open_rc(ts_client_t **c, const char *address, const ts_client_options_t *o,
                   const char *what)
{
    int rc = ts_client_open(c, address, o);
    printf("%s: %s: %s\n", what, ts_err_name(rc), rc != 0 ? ts_last_error() : "");
    return rc;
}

/*
 * The CA option, the server name, the tls flag and the open-time checks of a cluster client are
 * a single client's, for a list and a map file alike; the option wins over TS_TLS_CA.
 */
static void test_tls_cluster_options(void **state)
{
    (void)state;
    char list[LIST_CAP], plain_list[LIST_CAP];
    start_tls_shards(NULL, list, plain_list);
    unsetenv("TS_TLS_CA");
    ts_client_options_t o;
    tls_opts(&o);
    ts_client_t *c = NULL;
    assert_int_equal(open_rc(&c, list, &o, "cluster, tls_ca_file"), 0);
    cluster_roundtrip(c, "ca-opt");
    ts_client_free(c);

    /* A map file of tls:// lines. */
    char map[400], text[200];
    snprintf(map, sizeof(map), "%s/tls.map", certs.dir);
    snprintf(text, sizeof(text), "epoch 1\ntls://%s\ntls://%s\n", shards.srv[0].addr,
             shards.srv[1].addr);
    FILE *f = fopen(map, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
    char cluster_addr[420];
    snprintf(cluster_addr, sizeof(cluster_addr), "cluster:%s", map);
    assert_int_equal(open_rc(&c, cluster_addr, &o, "map file, tls_ca_file"), 0);
    cluster_roundtrip(c, "ca-map");
    ts_client_free(c);

    /* The option wins over TS_TLS_CA: a CA that signed nothing here is refused. */
    setenv("TS_TLS_CA", certs.ca, 1);
    o.tls_ca_file = certs.other_ca;
    assert_int_equal(open_rc(&c, list, &o, "cluster, other CA over TS_TLS_CA"), TS_EAUTH);
    assert_non_null(strstr(ts_last_error(), "certificate verification failed"));
    assert_int_equal(open_rc(&c, cluster_addr, &o, "map file, other CA"), TS_EAUTH);
    /* Without the option TS_TLS_CA serves. */
    o.tls_ca_file = NULL;
    assert_int_equal(open_rc(&c, list, &o, "cluster, TS_TLS_CA"), 0);
    cluster_roundtrip(c, "ca-env");
    ts_client_free(c);
    unsetenv("TS_TLS_CA");

    /* tls_server_name applies to every shard: one their certificate lacks is refused. */
    tls_opts(&o);
    o.tls_server_name = "not-the-server.example";
    assert_int_equal(open_rc(&c, list, &o, "cluster, other name"), TS_EAUTH);
    /* The tls option turns TLS on for a plain list; "localhost" is in the certificate. */
    tls_opts(&o);
    o.tls = 1;
    o.tls_server_name = "localhost";
    assert_int_equal(open_rc(&c, plain_list, &o, "plain list, tls = 1"), 0);
    cluster_roundtrip(c, "tls-flag");
    ts_client_free(c);

    /* The checks at open: a certificate without its key, a CA file that does not exist. */
    tls_opts(&o);
    o.tls_cert_file = certs.client_cert;
    assert_int_equal(open_rc(&c, list, &o, "cluster, cert without key"), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "tls_cert_file and tls_key_file go together"));
    tls_opts(&o);
    o.tls_ca_file = "/nonexistent/ca.pem";
    assert_int_equal(open_rc(&c, list, &o, "cluster, missing CA"), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "/nonexistent/ca.pem: No such file or directory"));
    unlink(map);
}

/* Shards with --tls-client-ca: refused without a client certificate, served with one. */
static void test_tls_cluster_client_cert(void **state)
{
    (void)state;
    char list[LIST_CAP], plain_list[LIST_CAP];
    const char *extra[] = {"--tls-client-ca", certs.ca, NULL};
    start_tls_shards(extra, list, plain_list);
    ts_client_options_t o;
    tls_opts(&o);
    o.connect_timeout_ms = 3000;
    ts_client_t *c = NULL;
    assert_int_not_equal(open_rc(&c, list, &o, "cluster, no client certificate"), 0);
    o.tls_cert_file = certs.client_cert;
    o.tls_key_file = certs.client_key;
    assert_int_equal(open_rc(&c, list, &o, "cluster, client certificate"), 0);
    cluster_roundtrip(c, "cert");
    ts_client_free(c);
}

/* tls = 1 on plain shards fails as a single client does, and without hanging. */
static void test_tls_cluster_on_plain_shards(void **state)
{
    (void)state;
    assert_int_equal(tsc_start(&shards, 2, NULL), 0);
    ts_client_options_t o;
    tls_opts(&o);
    o.tls = 1;
    o.connect_timeout_ms = 20000; /* longer than the test allows: the failure must come first */
    ts_client_t *c = NULL;
    uint64_t t0 = tc_now_ms();
    int single = open_rc(&c, shards.srv[0].addr, &o, "single client, tls = 1, plain daemon");
    assert_int_not_equal(single, 0);
    int rc = open_rc(&c, shards.list, &o, "cluster, tls = 1, plain daemons");
    assert_int_equal(rc, single);
    assert_true(tc_now_ms() - t0 < 15000);
    /* Without the option the same list opens. */
    ts_client_options_init(&o);
    assert_int_equal(open_rc(&c, shards.list, &o, "cluster, plain"), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_tls_put_get, case_teardown),
        cmocka_unit_test_teardown(test_tls_threads_reconnect, case_teardown),
        cmocka_unit_test_teardown(test_tls_verification, case_teardown),
        cmocka_unit_test_teardown(test_tls_reconnect_verification, case_teardown),
        cmocka_unit_test_teardown(test_tls_client_cert, case_teardown),
        cmocka_unit_test_teardown(test_tls_mismatch, case_teardown),
        cmocka_unit_test_teardown(test_tls_token, case_teardown),
        cmocka_unit_test_teardown(test_tls_cluster_options, case_teardown),
        cmocka_unit_test_teardown(test_tls_cluster_client_cert, case_teardown),
        cmocka_unit_test_teardown(test_tls_cluster_on_plain_shards, case_teardown),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
