/*
 * tensord authentication: the token from --auth-token-file or TS_AUTH_TOKEN, AUTH_REQUIRED and
 * AUTH_FAILED (then the connection closes), nothing but HELLO before it, the refusal to listen
 * beyond loopback without a token, --insecure, the pre-HELLO timeout, and the clients (the
 * library's option and environment variable, tsctl --token-file).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tensorshare/tensorshare.h"
#include "test_harden_util.h"

/* The daemon of the running test; a failed assertion leaves it to the teardown to stop. */
static tsh_server s;

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

#define TOKEN "correct horse battery staple 42"

static char dir[256], token_file[300], errfile[300];

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof(dir), "%s/thauth.XXXXXX", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp");
    if (mkdtemp(dir) == NULL)
        return -1;
    snprintf(token_file, sizeof(token_file), "%s/token", dir);
    snprintf(errfile, sizeof(errfile), "%s/stderr", dir);
    /* A trailing newline, as an editor or `echo` leaves it, is not part of the token. */
    return th_write_file(token_file, TOKEN "\n", strlen(TOKEN) + 1);
}

static int teardown(void **state)
{
    (void)state;
    unlink(token_file);
    unlink(errfile);
    rmdir(dir);
    return 0;
}

/* HELLO with token on a fresh connection; expect status, and the close when it is an error. */
static void hello_expect(const tsh_server *sv, const void *token, size_t len, uint16_t status)
{
    int fd = tsh_connect_tcp(sv->port);
    assert_true(fd >= 0);
    assert_int_equal(th_send_hello(fd, 9, token, len), 0);
    if (status == TS_ST_OK) {
        tsu_frame f;
        tsu_expect(fd, &f, TS_OP_HELLO, 9, TS_ST_OK);
        tsu_frame_free(&f);
        assert_int_equal(tsh_send(fd, TS_OP_PING, 10, NULL, 0), 0);
        tsu_expect(fd, &f, TS_OP_PING, 10, TS_ST_OK);
        tsu_frame_free(&f);
    } else {
        tsu_expect_error_close(fd, status);
    }
    close(fd);
}

/* A connection that has passed HELLO with the right token. */
static int authed_client(const tsh_server *sv)
{
    int fd = tsh_connect_tcp(sv->port);
    assert_true(fd >= 0);
    assert_int_equal(th_send_hello(fd, 1, TOKEN, strlen(TOKEN)), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_HELLO, 1, TS_ST_OK);
    tsu_frame_free(&f);
    return fd;
}

static void check_token_cases(const tsh_server *sv)
{
    hello_expect(sv, TOKEN, strlen(TOKEN), TS_ST_OK);
    hello_expect(sv, NULL, 0, TS_ST_AUTH_REQUIRED);
    hello_expect(sv, "wrong", 5, TS_ST_AUTH_FAILED);
    /* A prefix, the token with one more byte, one byte changed at the end, and at the start. */
    hello_expect(sv, TOKEN, strlen(TOKEN) - 1, TS_ST_AUTH_FAILED);
    hello_expect(sv, TOKEN "!", strlen(TOKEN) + 1, TS_ST_AUTH_FAILED);
    char t[64];
    memcpy(t, TOKEN, strlen(TOKEN));
    t[strlen(TOKEN) - 1] ^= 1;
    hello_expect(sv, t, strlen(TOKEN), TS_ST_AUTH_FAILED);
    memcpy(t, TOKEN, strlen(TOKEN));
    t[0] ^= 0x20;
    hello_expect(sv, t, strlen(TOKEN), TS_ST_AUTH_FAILED);
    /* The token with its newline is a different token. */
    hello_expect(sv, TOKEN "\n", strlen(TOKEN) + 1, TS_ST_AUTH_FAILED);

    /* Before authentication nothing but HELLO is read, and a PUT stores nothing. */
    int fd = tsh_connect_tcp(sv->port);
    size_t len;
    uint8_t *rec = tsu_rec_int(7, &len);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 3, "sneaky", rec, len), 0);
    tsu_rec_free(rec, len);
    tsu_expect_error_close(fd, TS_ST_BAD_REQUEST);
    close(fd);
    /* A large frame before HELLO is refused on its header. */
    fd = tsh_connect_tcp(sv->port);
    uint8_t big[8192];
    memset(big, 0, sizeof(big));
    big[0] = TS_PROTO_VERSION;
    ts__put_u16le(big + 2, 8000);
    assert_int_equal(tsh_send(fd, TS_OP_HELLO, 4, big, sizeof(big)), 0);
    tsu_expect_error_close(fd, TS_ST_TOO_LARGE);
    close(fd);

    fd = authed_client(sv);
    tsu_items it;
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 5, "sneaky", 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PEEK, 5, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
    tsu_put_int(fd, TS_OP_PUT, "fine", 11, NULL);
    tsu_get(fd, TS_OP_PEEK, "fine", 0, &it);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 11);
    tsu_frame_free(&it.f);
    assert_true(tsu_stat(fd, "auth_failures") >= 7);
    close(fd);
}

static void test_token_file(void **state)
{
    (void)state;
    /* These raw cases send the token in clear, as clients before 0.5.0 do. */
    const char *args[] = {"--auth-token-file", token_file, "--allow-plain-token", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    check_token_cases(&s);

    /* The library client: the option, then the environment variable, then a wrong token. */
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    o.connect_timeout_ms = 3000;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    setenv("TS_AUTH_TOKEN", TOKEN, 1);
    o.auth_token = NULL;
    assert_int_equal(ts_client_open(&c, s.unix_addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    unsetenv("TS_AUTH_TOKEN");
    o.auth_token = "not it";
    int rc = ts_client_open(&c, s.addr, &o);
    assert_int_equal(rc, TS_EAUTH);

    /* tsctl --token-file; without it, the server refuses. */
    const char *build = getenv("TS_BUILD_DIR");
    assert_non_null(build);
    char cmd[2048];
    snprintf(cmd, sizeof(cmd), "'%s/bin/tsctl' --port %d --token-file '%s' put t 1 >/dev/null",
             build, s.port, token_file);
    assert_int_equal(system(cmd), 0);
    snprintf(cmd, sizeof(cmd), "'%s/bin/tsctl' --port %d --timeout 3000 ping 2>/dev/null", build,
             s.port);
    int st = system(cmd);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

static void test_token_env(void **state)
{
    (void)state;
    /* Trailing whitespace is not part of the token, on either side. */
    setenv("TS_AUTH_TOKEN", TOKEN " \t\r\n", 1);
    const char *args[] = {"--allow-plain-token", NULL};
    int rc = tsh_server_start(&s, args);
    assert_int_equal(rc, 0);
    check_token_cases(&s);
    /* The library client, given the same variable, proves the same token. */
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 3000;
    ts_client_t *c;
    rc = ts_client_open(&c, s.addr, &o);
    if (rc != 0)
        fail_msg("TS_AUTH_TOKEN with a trailing newline: %s (%s)", ts_err_name(rc),
                 ts_last_error());
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    unsetenv("TS_AUTH_TOKEN");
    o.auth_token = TOKEN " ";
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    /* Nothing left after trimming: refused, not taken for no token. */
    o.auth_token = " \n";
    assert_int_equal(ts_client_open(&c, s.addr, &o), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "auth_token is empty after trimming"));
    setenv("TS_AUTH_TOKEN", "\t", 1);
    o.auth_token = NULL;
    assert_int_equal(ts_client_open(&c, s.addr, &o), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "TS_AUTH_TOKEN is empty after trimming"));
    unsetenv("TS_AUTH_TOKEN");
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

static void test_bad_token_config(void **state)
{
    (void)state;
    char empty[320], missing[320];
    snprintf(empty, sizeof(empty), "%s/empty", dir);
    snprintf(missing, sizeof(missing), "%s/missing", dir);
    assert_int_equal(th_write_file(empty, "\n", 1), 0);
    const char *a1[] = {"--port", "0", "--auth-token-file", empty, NULL};
    assert_int_equal(th_run_tensord(a1, errfile, 10000), 2);
    assert_true(th_file_contains(errfile, "is empty"));
    const char *a2[] = {"--port", "0", "--auth-token-file", missing, NULL};
    assert_int_equal(th_run_tensord(a2, errfile, 10000), 2);
    assert_true(th_file_contains(errfile, missing));
    /* A variable of whitespace only is an empty token, which is said as such. */
    setenv("TS_AUTH_TOKEN", " \n", 1);
    const char *a3[] = {"--port", "0", NULL};
    int rc = th_run_tensord(a3, errfile, 10000);
    unsetenv("TS_AUTH_TOKEN");
    assert_int_equal(rc, 2);
    assert_true(th_file_contains(errfile, "TS_AUTH_TOKEN is empty after trimming"));
    unlink(empty);
    /*
     * A token file others can read is warned about in the log's format, and --log-level error
     * silences it like any warning (the --save in a missing directory ends the start after it).
     */
    char open_file[320], no_dir[320];
    snprintf(open_file, sizeof(open_file), "%s/open", dir);
    snprintf(no_dir, sizeof(no_dir), "%s/no-such-dir/snap", dir);
    assert_int_equal(th_write_file(open_file, TOKEN, strlen(TOKEN)), 0);
    assert_int_equal(chmod(open_file, 0644), 0);
    const char *a4[] = {"--port", "0", "--auth-token-file", open_file, "--save", no_dir, NULL};
    assert_int_equal(th_run_tensord(a4, errfile, 10000), 2);
    assert_true(th_file_contains(errfile, "] warn: --auth-token-file"));
    assert_true(th_file_contains(errfile, "can be read by other users"));
    assert_false(th_file_contains(errfile, "tensord: warning"));
    const char *a5[] = {"--port",  "0",           "--auth-token-file",
                        open_file, "--log-level", "error",
                        "--save",  no_dir,        NULL};
    assert_int_equal(th_run_tensord(a5, errfile, 10000), 2);
    assert_false(th_file_contains(errfile, "can be read by other users"));
    assert_true(th_file_contains(errfile, "no-such-dir")); /* the error is still logged */
    unlink(open_file);
}

static void test_non_loopback_needs_token(void **state)
{
    (void)state;
    /* Refused before anything listens: exit status 2 and a message that says what to do. */
    static const char *const hosts[] = {"0.0.0.0", "::", "10.1.2.3"};
    for (size_t i = 0; i < 3; i++) {
        const char *a[] = {"--port", "0", "--host", hosts[i], NULL};
        assert_int_equal(th_run_tensord(a, errfile, 10000), 2);
        assert_true(th_file_contains(errfile, "refusing to listen"));
        assert_true(th_file_contains(errfile, "--insecure"));
    }
    /*
     * Only numeric addresses are taken, with or without --insecure: a host name, a port or
     * garbage is a bad value (exit status 2) named as such, not an unsafe address.
     */
    static const char *const not_numeric[] = {"localhost", "example.com", "127.0.0.1:8000",
                                              "1.2.3",     "::zz",        ""};
    for (size_t i = 0; i < TS__ARRAY_SIZE(not_numeric); i++) {
        for (int insecure = 0; insecure < 2; insecure++) {
            const char *a[] = {
                "--port", "0", "--host", not_numeric[i], insecure ? "--insecure" : NULL, NULL};
            if (th_run_tensord(a, errfile, 10000) != 2)
                fail_msg("--host '%s' was not refused with exit status 2", not_numeric[i]);
            assert_true(th_file_contains(errfile, "only a numeric IPv4 or IPv6 address"));
            assert_false(th_file_contains(errfile, "refusing to listen"));
        }
        const char *h[] = {"--port", "0", "--http-port", "0", "--http-host", not_numeric[i], NULL};
        if (th_run_tensord(h, errfile, 10000) != 2)
            fail_msg("--http-host '%s' was not refused with exit status 2", not_numeric[i]);
        assert_true(th_file_contains(errfile, "bad value for --http-host"));
    }
    /* Loopback needs nothing. */
    const char *lo[] = {"--host", "127.0.0.2", NULL};
    assert_int_equal(tsh_server_start(&s, lo), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
    /* --insecure starts on every address (the test talks to it over 127.0.0.1 only). */
    const char *ins[] = {"--host", "0.0.0.0", "--insecure", NULL};
    assert_int_equal(tsh_server_start(&s, ins), 0);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
    /* So does a token, which every client must then present. */
    const char *tok[] = {"--host", "0.0.0.0", "--auth-token-file", token_file, NULL};
    assert_int_equal(tsh_server_start(&s, tok), 0);
    hello_expect(&s, NULL, 0, TS_ST_AUTH_REQUIRED);
    /* In clear the token is refused (without --allow-plain-token); its proof gets in. */
    hello_expect(&s, TOKEN, strlen(TOKEN), TS_ST_AUTH_FAILED);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = TOKEN;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    assert_int_equal(ts_ping(c), 0);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

static void test_hello_timeout(void **state)
{
    (void)state;
    const char *args[] = {"--hello-timeout", "600", NULL};
    assert_int_equal(tsh_server_start(&s, args), 0);
    int idle = tsh_connect_tcp(s.port);
    int half = tsh_connect_tcp(s.port);
    assert_true(idle >= 0 && half >= 0);
    assert_int_equal(tsh_write_all(half, "\x54\x01", 2), 0);
    int good = tsu_client(&s);
    /* Both silent ones are told why and closed; the cron checks twice a second. */
    tsu_expect_error_close(idle, TS_ST_TIMEOUT);
    tsu_expect_error_close(half, TS_ST_TIMEOUT);
    close(idle);
    close(half);
    /* The one that said HELLO stays. */
    th_sleep_ms(700);
    assert_int_equal(tsh_send(good, TS_OP_PING, 2, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(good, &f, TS_OP_PING, 2, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(good, "hello_timeouts"), 2);
    close(good);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

static void test_bad_flags_exit_2(void **state)
{
    (void)state;
    const char *a1[] = {"--port", "0", "--no-such-flag", NULL};
    assert_int_equal(th_run_tensord(a1, errfile, 10000), 2);
    const char *a2[] = {"--port", "0", "--output-soft", "lots", NULL};
    assert_int_equal(th_run_tensord(a2, errfile, 10000), 2);
    const char *a3[] = {"--help", NULL};
    assert_int_equal(th_run_tensord(a3, errfile, 10000), 0);
    /* A value given to a flag that takes none is named as such, not as an unknown flag. */
    static const char *const no_value[] = {"--insecure=yes", "--no-fds=1",
                                           "--allow-plain-token=", "--help=x", "--version=1"};
    for (size_t i = 0; i < TS__ARRAY_SIZE(no_value); i++) {
        const char *a[] = {"--port", "0", no_value[i], NULL};
        if (th_run_tensord(a, errfile, 10000) != 2)
            fail_msg("%s was not refused with exit status 2", no_value[i]);
        assert_true(th_file_contains(errfile, "takes no value"));
        assert_false(th_file_contains(errfile, "unknown flag"));
    }
    /* Each numeric flag's range as SAFETY.md's Limits gives it: one past either end is refused. */
    static const char *const out_of_range[][2] = {
        {"--port", "65536"},
        {"--http-port", "64k"},
        {"--max-frame", "0"},
        {"--max-frame", "1"},
        {"--max-frame", "4095"},
        {"--max-clients", "0"},
        {"--max-clients", "4g"},
        {"--max-unauth-clients", "4294967296"},
        {"--max-watch", "0"},
        {"--hello-timeout", "4g"},
        {"--body-timeout", "86401"},
        {"--output-soft-seconds", "31536001"},
        {"--save-interval", "1g"},
        {"--max-disk", "18446744073709551615"},
        {"--max-memory", "18446744073709551616"},
        {"--max-output", "17179869184g"},
    };
    for (size_t i = 0; i < sizeof(out_of_range) / sizeof(out_of_range[0]); i++) {
        const char *a[] = {"--port", "0", out_of_range[i][0], out_of_range[i][1], NULL};
        if (th_run_tensord(a, errfile, 10000) != 2)
            fail_msg("%s %s was not refused", out_of_range[i][0], out_of_range[i][1]);
        assert_true(th_file_contains(errfile, "bad value for"));
    }
    /* The ends themselves are taken; at the smallest --max-frame a client still gets in. */
    const char *top[] = {"--max-frame",
                         "4096",
                         "--hello-timeout",
                         "4294967295",
                         "--body-timeout",
                         "86400",
                         "--output-soft-seconds",
                         "31536000",
                         "--save-interval",
                         "31536000",
                         "--max-watch",
                         "4294967295",
                         NULL};
    assert_int_equal(tsh_server_start(&s, top), 0);
    tsu_check_healthy(&s);
    assert_int_equal(tsh_server_stop(&s), 0);
    tsh_server_cleanup(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_token_file, kill_leftover),
        cmocka_unit_test_teardown(test_token_env, kill_leftover),
        cmocka_unit_test_teardown(test_bad_token_config, kill_leftover),
        cmocka_unit_test_teardown(test_non_loopback_needs_token, kill_leftover),
        cmocka_unit_test_teardown(test_hello_timeout, kill_leftover),
        cmocka_unit_test_teardown(test_bad_flags_exit_2, kill_leftover),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
