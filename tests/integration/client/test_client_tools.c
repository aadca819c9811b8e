/*
 * The programs built on libtensorshare: examples/quickstart and tsctl (every command, its exit
 * codes, .npy files and literals) against a real tensord, plus tsctl's .npy and literal code.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "npy.h"
#include "test_client_util.h"
#ifdef TS_WITH_TLS
#include "cluster.h"
#include "tls_certs.h"
#endif

static tsh_server srv;
static char tsctl[600], quickstart[600], port_arg[16], out_path[300];

static int group_setup(void **state)
{
    (void)state;
    const char *build = getenv("TS_BUILD_DIR");
    if (build == NULL || tsh_server_start(&srv, NULL) != 0)
        return -1;
    snprintf(tsctl, sizeof(tsctl), "%s/bin/tsctl", build);
    snprintf(quickstart, sizeof(quickstart), "%s/examples/quickstart", build);
    snprintf(port_arg, sizeof(port_arg), "%d", srv.port);
    snprintf(out_path, sizeof(out_path), "%s/out.txt", srv.dir);
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    unlink(out_path);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* A child started by spawn(): its pid and where its output goes. */
typedef struct child {
    pid_t pid;
} child;

/* Start argv (NULL-terminated) with stdout and stderr going to out_path. */
static child spawn(const char *const *argv)
{
    child ch = {fork()};
    if (ch.pid == 0) {
        int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return ch;
}

/* Wait for a child at most timeout_ms (then kill it). Its exit status, or -1. */
static int reap(child ch, int timeout_ms)
{
    uint64_t until = tc_now_ms() + (uint64_t)timeout_ms;
    int st;
    while (waitpid(ch.pid, &st, WNOHANG) == 0) {
        if (tc_now_ms() > until) {
            kill(ch.pid, SIGKILL);
            waitpid(ch.pid, &st, 0);
            return -1;
        }
        tc_sleep_ms(5);
    }
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/*
 * Run argv to the end with files limited to limit bytes; a write past it raises SIGXFSZ, or,
 * with ignore_xfsz, fails with EFBIG.
 */
static int run_fsize_limited(const char *const *argv, rlim_t limit, int ignore_xfsz)
{
    child ch = {fork()};
    if (ch.pid == 0) {
        int fd = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
            close(fd);
        }
        struct rlimit rl = {limit, limit};
        signal(SIGXFSZ, ignore_xfsz ? SIG_IGN : SIG_DFL); /* kept across exec */
        setrlimit(RLIMIT_FSIZE, &rl);
        execv(argv[0], (char *const *)argv);
        _exit(127);
    }
    return reap(ch, 60000);
}

/* Run a program to the end; its output is in out_path. */
static int run(const char *const *argv)
{
    return reap(spawn(argv), 60000);
}

/* 1 when the last run's output contains s. */
static int output_has(const char *s)
{
    static char buf[65536];
    FILE *f = fopen(out_path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    return strstr(buf, s) != NULL;
}

/* How many times the last run's output contains s. */
static int output_count(const char *s)
{
    static char buf[65536];
    FILE *f = fopen(out_path, "r");
    if (f == NULL)
        return 0;
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    fclose(f);
    buf[n] = '\0';
    int count = 0;
    for (const char *p = strstr(buf, s); p != NULL; p = strstr(p + 1, s))
        count++;
    return count;
}

/* 1 when the last run's output holds a byte below 0x20 other than newline, or 0x7f. */
static int output_has_control(void)
{
    FILE *f = fopen(out_path, "r");
    if (f == NULL)
        return 0;
    int ch, found = 0;
    while ((ch = fgetc(f)) != EOF)
        found |= (ch < 0x20 && ch != '\n') || ch == 0x7f;
    fclose(f);
    return found;
}

/* 1 when dir holds an entry whose name starts with prefix. */
static int dir_has(const char *dir, const char *prefix)
{
    DIR *d = opendir(dir);
    if (d == NULL)
        return 0;
    int found = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        found |= strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    closedir(d);
    return found;
}

/* tsctl --port PORT args... */
#define TSCTL(...) run((const char *const[]){tsctl, "--port", port_arg, __VA_ARGS__, NULL})

static void test_quickstart(void **state)
{
    (void)state;
    assert_int_equal(run((const char *const[]){quickstart, srv.addr, NULL}), 0);
    assert_true(output_has("4 notification(s) seen"));
    assert_true(output_has("done"));
    assert_int_equal(run((const char *const[]){quickstart, srv.unix_addr, NULL}), 0);
    /* Nothing listens on port 1: a clear failure. */
    assert_int_equal(run((const char *const[]){quickstart, "127.0.0.1:1", NULL}), 1);
    assert_true(output_has("connection refused"));
}

static void test_npy_and_literals(void **state)
{
    (void)state;
    char err[256], path[300];
    snprintf(path, sizeof(path), "%s/a.npy", srv.dir);
    int64_t shape[3] = {2, 3, 4};
    for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
        if (ts__npy_descr((ts_dtype_t)dt) == NULL) {
            assert_int_equal(dt, TS_BFLOAT16); /* NumPy has no bfloat16 */
            continue;
        }
        ts_value_t *t = ts_tensor_alloc((ts_dtype_t)dt, 3, shape);
        uint8_t *d = ts_value_tensor(t)->data;
        size_t n = ts_tensor_nbytes(ts_value_tensor(t));
        for (size_t i = 0; i < n; i++)
            d[i] = dt == TS_BOOL ? (uint8_t)(i & 1) : (uint8_t)(i * 7);
        assert_int_equal(ts__npy_write(path, ts_value_tensor(t), err, sizeof(err)), 0);
        ts_value_t *back;
        assert_int_equal(ts__npy_read(path, &back, err, sizeof(err)), 0);
        const ts_tensor_t *b = ts_value_tensor(back);
        assert_int_equal(b->dtype, dt);
        assert_int_equal(b->ndim, 3);
        assert_int_equal(b->shape[2], 4);
        assert_memory_equal(b->data, d, n);
        ts_value_free(back);
        ts_value_free(t);
    }
    /* A header written by NumPy itself (version 1.0, Fortran order refused). */
    FILE *f = fopen(path, "wb");
    const char hdr[] = "{'descr': '<i8', 'fortran_order': False, 'shape': (3,), }";
    char line[118];
    memset(line, ' ', sizeof(line));
    memcpy(line, hdr, sizeof(hdr) - 1);
    line[sizeof(line) - 1] = '\n';
    uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, sizeof(line), 0};
    int64_t vals[3] = {-1, 0, 42};
    fwrite(pre, 1, 10, f);
    fwrite(line, 1, sizeof(line), f);
    fwrite(vals, 1, sizeof(vals), f);
    fclose(f);
    ts_value_t *v;
    assert_int_equal(ts__npy_read(path, &v, err, sizeof(err)), 0);
    assert_int_equal(ts_value_tensor(v)->dtype, TS_INT64);
    assert_memory_equal(ts_value_tensor(v)->data, vals, sizeof(vals));
    ts_value_free(v);
    f = fopen(path, "r+b");
    fseek(f, 10 + (long)(strstr(hdr, "False") - hdr), SEEK_SET); /* "False" -> "True " */
    fwrite("True ", 1, 5, f);
    fclose(f);
    assert_int_equal(ts__npy_read(path, &v, err, sizeof(err)), TS_EINVAL);
    assert_non_null(strstr(err, "C-order"));
    unlink(path);

    assert_int_equal(ts__literal_parse("3.5", &v, err, sizeof(err)), 0);
    assert_int_equal(ts_value_tensor(v)->ndim, 0);
    assert_true(((float *)ts_value_tensor(v)->data)[0] == 3.5f);
    ts_value_free(v);
    assert_int_equal(ts__literal_parse(" [ [1, 2,3], [4,5,6] ] ", &v, err, sizeof(err)), 0);
    const ts_tensor_t *t = ts_value_tensor(v);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_true(((float *)t->data)[5] == 6.0f);
    ts_value_free(v);
    assert_int_equal(ts__literal_parse("[]", &v, err, sizeof(err)), 0);
    assert_int_equal(ts_value_tensor(v)->shape[0], 0);
    ts_value_free(v);
    static const char *const bad[] = {"", "[1,2", "[[1,2],[3]]", "[[1],2]", "abc", "[1 2]", "1,2"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        assert_int_equal(ts__literal_parse(bad[i], &v, err, sizeof(err)), TS_EINVAL);
}

/* Wait (bounded) until the server counts n listeners. The last count seen, -1 on an error. */
static int64_t wait_listeners(ts_client_t *c, int64_t n)
{
    int64_t listeners = -1;
    for (int i = 0; i < 1000 && listeners != n; i++) {
        ts_value_t *stats;
        if (ts_stats(c, &stats) != 0)
            return -1;
        ts_map_get_int(stats, "listeners", &listeners);
        ts_value_free(stats);
        if (listeners != n)
            tc_sleep_ms(10);
    }
    return listeners;
}

static void test_tsctl_commands(void **state)
{
    (void)state;
    char npy[300], got[300];
    snprintf(npy, sizeof(npy), "%s/in.npy", srv.dir);
    snprintf(got, sizeof(got), "%s/got.npy", srv.dir);
    char err[256];

    assert_int_equal(TSCTL("ping"), 0);
    assert_true(output_has("PONG"));
    assert_int_equal(run((const char *const[]){tsctl, "--unix", srv.unix_path, "ping", NULL}), 0);
    assert_int_equal(TSCTL("put", "b", "[[1,2],[3,4]]"), 0);
    assert_true(output_has("OK change"));
    int64_t shape[1] = {3};
    int64_t iv[3] = {7, 8, 9};
    ts_value_t *t = ts_tensor_new(TS_INT64, 1, shape, iv, TS_BORROW);
    assert_int_equal(ts__npy_write(npy, ts_value_tensor(t), err, sizeof(err)), 0);
    ts_value_free(t);
    assert_int_equal(TSCTL("append", "b", npy), 0);
    assert_int_equal(TSCTL("list"), 0);
    assert_true(output_has("b "));
    assert_int_equal(TSCTL("peek", "b", "--out", got), 0);
    assert_true(output_has("2 items"));
    assert_true(output_has("float32[2, 2] {1, 2, 3, 4}"));
    assert_true(output_has("int64[3] {7, 8, 9}"));
    ts_value_t *back;
    assert_int_equal(ts__npy_read(got, &back, err, sizeof(err)), 0);
    assert_int_equal(ts_value_tensor(back)->dtype, TS_FLOAT32);
    assert_int_equal(ts_value_tensor(back)->shape[1], 2);
    ts_value_free(back);
    assert_int_equal(TSCTL("get", "b"), 0);
    assert_int_equal(TSCTL("get", "b"), 4); /* no such bin */
    assert_true(output_has("no such bin"));
    assert_int_equal(TSCTL("peek", "b"), 4);
    assert_int_equal(TSCTL("wait", "b", "--timeout", "200"), 3);
    assert_true(output_has("timed out"));
    assert_int_equal(TSCTL("append", "b", "2.5"), 0);
    assert_int_equal(TSCTL("wait", "b", "0", "--timeout", "5000"), 0);
    assert_true(output_has("1 items"));
    assert_int_equal(TSCTL("delete", "b"), 0);
    assert_true(output_has("removed 1 item"));
    assert_int_equal(TSCTL("stats"), 0);
    assert_true(output_has("connections"));

    /* listen: start it, wait until the server has the listener, then make two changes. */
    child ch = spawn(
        (const char *const[]){tsctl, "--port", port_arg, "listen", "lb", "--count", "2", NULL});
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    assert_int_equal(wait_listeners(c, 1), 1);
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(c, "lb", one, NULL), 0);
    assert_int_equal(ts_append(c, "lb", one, NULL), 0);
    assert_int_equal(reap(ch, 30000), 0);
    assert_true(output_has("lb put change"));
    assert_true(output_has("lb append change"));
    ts_value_free(one);
    assert_int_equal(ts_delete(c, "lb", NULL), 0);
    ts_client_free(c);

    /* Mistakes: usage errors give 2, unreachable servers 1. */
    assert_int_equal(TSCTL("frobnicate"), 2);
    assert_int_equal(TSCTL("put", "b"), 2);
    assert_int_equal(TSCTL("put", "b", "[1,"), 2);
    assert_int_equal(TSCTL("put", "b", "/nonexistent.npy"), 2);
    assert_int_equal(run((const char *const[]){tsctl, NULL}), 2);
    assert_int_equal(run((const char *const[]){tsctl, "--port", "1", "ping", NULL}), 1);
    assert_true(output_has("connection refused"));
    assert_int_equal(run((const char *const[]){tsctl, "--help", NULL}), 0);
    unlink(npy);
    unlink(got);
}

/* listen --count N prints N changes and no more, even when many arrive at once. */
static void test_tsctl_listen_count(void **state)
{
    (void)state;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    assert_int_equal(wait_listeners(c, 0), 0); /* an earlier test's listener has gone */
    child ch = spawn(
        (const char *const[]){tsctl, "--port", port_arg, "listen", "burst", "--count", "1", NULL});
    assert_int_equal(wait_listeners(c, 1), 1);
    /* Twenty changes pipelined on one connection: their notifications come in one burst. */
    ts_value_t *one = ts_int_new(1);
    for (int i = 0; i < 20; i++)
        assert_int_equal(ts_put_async(c, "burst", one, TS_COPY, NULL, NULL), 0);
    ts_value_free(one);
    assert_int_equal(ts_ping(c), 0);
    assert_int_equal(reap(ch, 30000), 0);
    assert_int_equal(output_count("burst put change"), 1);
    assert_int_equal(ts_delete(c, "burst", NULL), 0);
    ts_client_free(c);
}

/* get --out takes nothing when the output cannot be written: the items stay in the bin. */
static void test_tsctl_get_out_keeps_items(void **state)
{
    (void)state;
    char got[300];
    snprintf(got, sizeof(got), "%s/kept.npy", srv.dir);
    assert_int_equal(TSCTL("append", "keep", "[1,2,3]"), 0);
    /* A directory that does not exist: refused before anything is taken. */
    assert_int_equal(TSCTL("get", "keep", "--out", "/nonexistent-dir/x.npy"), 1);
    assert_true(output_has("/nonexistent-dir"));
    assert_int_equal(TSCTL("peek", "keep"), 0);
    assert_true(output_has("1 item,"));
    /* A first item without a tensor: nothing to write, nothing taken, no file left behind. */
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(c, "notensor", one, NULL), 0);
    ts_value_free(one);
    assert_int_equal(TSCTL("get", "notensor", "--out", got), 1);
    assert_true(output_has("no tensor"));
    assert_int_equal(TSCTL("peek", "notensor"), 0);
    assert_true(output_has("1 item,"));
    assert_int_equal(access(got, F_OK), -1);
    assert_false(dir_has(srv.dir, ".kept.npy"));
    assert_int_equal(ts_delete(c, "notensor", NULL), 0);
    /* A write that fails after the get (here: a file size limit, as a full disk would): the
       items go back to the bin, and no file is left. tsctl ignores SIGXFSZ itself, so this
       holds whether the limit's signal is ignored or not. */
    int64_t big_shape[1] = {1 << 16};
    ts_value_t *big = ts_tensor_alloc(TS_FLOAT32, 1, big_shape);
    memset(ts_value_tensor(big)->data, 0, ts_tensor_nbytes(ts_value_tensor(big)));
    for (int ignore_xfsz = 0; ignore_xfsz <= 1; ignore_xfsz++) {
        assert_int_equal(ts_put(c, "big", big, NULL), 0);
        assert_int_equal(run_fsize_limited((const char *const[]){tsctl, "--port", port_arg, "get",
                                                                 "big", "--out", got, NULL},
                                           16384, ignore_xfsz),
                         1);
        assert_true(output_has("went back"));
        assert_int_equal(access(got, F_OK), -1);
        assert_false(dir_has(srv.dir, ".kept.npy"));
        assert_int_equal(TSCTL("peek", "big"), 0);
        assert_true(output_has("1 item,"));
        assert_int_equal(ts_delete(c, "big", NULL), 0);
    }
    ts_value_free(big);
    ts_client_free(c);
    /* A writable output: the items are taken and the file holds the first tensor. */
    assert_int_equal(TSCTL("get", "keep", "--out", got), 0);
    assert_true(output_has("wrote"));
    assert_int_equal(TSCTL("peek", "keep"), 4);
    char err[256];
    ts_value_t *back;
    assert_int_equal(ts__npy_read(got, &back, err, sizeof(err)), 0);
    assert_int_equal(ts_value_tensor(back)->shape[0], 3);
    ts_value_free(back);
    assert_false(dir_has(srv.dir, ".kept.npy"));
    unlink(got);
}

/* Options: --opt=value, --opt value, short forms, --version, and usage errors that name the
   offending argument in one line. */
static void test_tsctl_options(void **state)
{
    (void)state;
    char port_eq[32];
    snprintf(port_eq, sizeof(port_eq), "--port=%d", srv.port);
    assert_int_equal(run((const char *const[]){tsctl, port_eq, "ping", NULL}), 0);
    assert_int_equal(run((const char *const[]){tsctl, "-p", port_arg, "ping", NULL}), 0);
    assert_int_equal(run((const char *const[]){tsctl, "ping", "--port", port_arg, NULL}), 0);
    assert_int_equal(TSCTL("put", "opt", "-2.5"), 0); /* a negative literal is no option */
    assert_int_equal(TSCTL("peek", "opt"), 0);
    assert_true(output_has("{-2.5}"));
    assert_int_equal(TSCTL("wait", "opt", "--timeout=100"), 3);
    assert_int_equal(TSCTL("delete", "opt"), 0);

    assert_int_equal(run((const char *const[]){tsctl, "--version", NULL}), 0);
    assert_true(output_has(TS_VERSION_STRING));
    assert_true(output_has("protocol version 1"));

    assert_int_equal(TSCTL("--frob", "ping"), 2);
    assert_true(output_has("tsctl: unknown option '--frob'; see tsctl --help"));
    assert_false(output_has("Commands:"));
    assert_int_equal(TSCTL("frobnicate"), 2);
    assert_true(output_has("'frobnicate'"));
    assert_false(output_has("Commands:"));
    assert_int_equal(run((const char *const[]){tsctl, "ping", "--port", NULL}), 2);
    assert_true(output_has("'--port'"));
    assert_int_equal(run((const char *const[]){tsctl, "--port=0", "ping", NULL}), 2);
    assert_true(output_has("'0'"));
    assert_int_equal(TSCTL("list", "extra"), 2);
    assert_true(output_has("'extra'"));
    assert_int_equal(TSCTL("list", "--out", "x.npy"), 2);
    assert_true(output_has("'--out'"));
    assert_int_equal(run((const char *const[]){tsctl, "--help", NULL}), 0);
    assert_true(output_has("Commands:"));
}

/*
 * list escapes control characters, backslashes and invalid UTF-8 in bin names, and so do the
 * error messages that name a bin.
 */
static void test_tsctl_list_escapes(void **state)
{
    (void)state;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    ts_value_t *one = ts_int_new(1);
    assert_int_equal(ts_put(c, "red\x1b[31mX\x7f", one, NULL), 0);
    assert_int_equal(ts_put(c, "back\\slash\xff", one, NULL), 0);
    assert_int_equal(ts_put(c, "caf\xc3\xa9", one, NULL), 0);
    assert_int_equal(TSCTL("list"), 0);
    assert_false(output_has_control());
    assert_true(output_has("red\\x1b[31mX\\x7f"));
    assert_true(output_has("back\\\\slash\\xff"));
    assert_true(output_has("caf\xc3\xa9")); /* valid UTF-8 is shown as it is */
    /* Error messages name a bin the same way (the server escapes it in its message). */
    assert_int_equal(TSCTL("peek", "no\x01such\x1b[31mred\xff\\\xc2\x85"), 4);
    assert_false(output_has_control());
    assert_true(output_has("no such bin: no\\x01such\\x1b[31mred\\xff\\\\\\xc2\\x85"));
    assert_int_equal(ts_delete(c, "red\x1b[31mX\x7f", NULL), 0);
    assert_int_equal(ts_delete(c, "back\\slash\xff", NULL), 0);
    assert_int_equal(ts_delete(c, "caf\xc3\xa9", NULL), 0);
    ts_value_free(one);
    ts_client_free(c);
}

/* A second server for one test, with flags of its own; stopped by aux_teardown even when the
   test fails. */
static tsh_server aux;
static char aux_port[16], token_path[300], wrong_path[300];

static int aux_start(const char *const *args)
{
    memset(&aux, 0, sizeof(aux));
    if (tsh_server_start(&aux, args) != 0)
        return -1;
    snprintf(aux_port, sizeof(aux_port), "%d", aux.port);
    return 0;
}

static int aux_teardown(void **state)
{
    (void)state;
    int rc = aux.pid > 0 ? tsh_server_stop(&aux) : 0;
    if (aux.pid > 0)
        tsh_server_cleanup(&aux);
    memset(&aux, 0, sizeof(aux));
    unlink(token_path);
    unlink(wrong_path);
    return rc == 0 ? 0 : -1;
}

static int auth_setup(void **state)
{
    (void)state;
    snprintf(token_path, sizeof(token_path), "%s/token", srv.dir);
    snprintf(wrong_path, sizeof(wrong_path), "%s/wrong", srv.dir);
    FILE *f = fopen(token_path, "w");
    if (f == NULL)
        return -1;
    fputs("s3cret\n", f);
    fclose(f);
    chmod(token_path, 0600);
    f = fopen(wrong_path, "w");
    if (f == NULL)
        return -1;
    fputs("nope\n", f);
    fclose(f);
    const char *const args[] = {"--auth-token-file", token_path, NULL};
    return aux_start(args);
}

static int full_setup(void **state)
{
    (void)state;
    const char *const args[] = {"--max-clients", "1", NULL};
    return aux_start(args);
}

/* Token errors: the hint names both ways to give one, and no message is printed twice. */
static void test_tsctl_auth_errors(void **state)
{
    (void)state;
    unsetenv("TS_AUTH_TOKEN");
    assert_int_equal(run((const char *const[]){tsctl, "--port", aux_port, "ping", NULL}), 1);
    assert_true(output_has("TS_AUTH_TOKEN"));
    assert_true(output_has("--token-file"));
    assert_false(output_has("certificate"));
    assert_int_equal(run((const char *const[]){tsctl, "--port", aux_port, "--token-file",
                                               wrong_path, "ping", NULL}),
                     1);
    assert_int_equal(output_count("authentication failed"), 1);
    assert_true(output_has(wrong_path));
    assert_int_equal(run((const char *const[]){tsctl, "--port", aux_port, "--token-file",
                                               token_path, "ping", NULL}),
                     0);
}

/*
 * --address takes whatever ts_client_open takes (tcp://, unix:, tls://, a shard list), and
 * refuses to be mixed with -H/-p/-u; -H refuses a whole address; --tls-ca (or TS_TLS_CA) is the
 * CA a tls:// server's certificate is checked against.
 */
static void test_tsctl_address(void **state)
{
    (void)state;
    char tcp[64], tcp_list[400];
    snprintf(tcp, sizeof(tcp), "tcp://127.0.0.1:%d", srv.port);
    snprintf(tcp_list, sizeof(tcp_list), "127.0.0.1:%d,%s", srv.port, srv.unix_addr);
    assert_int_equal(run((const char *const[]){tsctl, "--address", tcp, "ping", NULL}), 0);
    assert_int_equal(run((const char *const[]){tsctl, "-a", srv.unix_addr, "ping", NULL}), 0);
    assert_int_equal(run((const char *const[]){tsctl, "-a", tcp_list, "ping", NULL}), 0);
    /* A list that names an address twice is a usage error. */
    snprintf(tcp_list, sizeof(tcp_list), "127.0.0.1:%d,%s", srv.port, tcp);
    assert_int_equal(run((const char *const[]){tsctl, "-a", tcp_list, "ping", NULL}), 2);
    assert_true(output_has("is also shard 0's"));
    /* Malformed: a usage error naming the address, not a resolver's failure. */
    static const char *const bad[] = {"http://127.0.0.1:80", "h1:1,h2:p2", "[x,y]:1"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(run((const char *const[]){tsctl, "-a", bad[i], "ping", NULL}), 2);
        assert_true(output_has("malformed address"));
    }
    assert_int_equal(run((const char *const[]){tsctl, "-a", tcp, "-p", port_arg, "ping", NULL}), 2);
    assert_true(output_has("leave out --host, --port and --unix"));
    assert_int_equal(run((const char *const[]){tsctl, "-H", "h1:1,h2:2", "ping", NULL}), 2);
    assert_true(output_has("--address"));
    assert_int_equal(run((const char *const[]){tsctl, "-H", "tls://127.0.0.1", "ping", NULL}), 2);
    assert_true(output_has("--address"));
    assert_int_equal(run((const char *const[]){tsctl, "--help", NULL}), 0);
    assert_true(output_has("--address ADDR"));
    assert_true(output_has("--tls-ca FILE"));
#ifdef TS_WITH_TLS
    tls_certs certs;
    assert_int_equal(tls_certs_make(&certs), 0);
    const char *const args[] = {"--tls-cert", certs.server_cert, "--tls-key", certs.server_key,
                                NULL};
    assert_int_equal(aux_start(args), 0);
    char tls[64];
    snprintf(tls, sizeof(tls), "tls://127.0.0.1:%d", aux.port);
    unsetenv("TS_TLS_CA");
    assert_int_equal(
        run((const char *const[]){tsctl, "-a", tls, "--tls-ca", certs.ca, "ping", NULL}), 0);
    assert_int_equal(run((const char *const[]){tsctl, "-a", tls, "--tls-ca", certs.ca, "put",
                                               "tlsbin", "1.5", NULL}),
                     0);
    assert_int_equal(
        run((const char *const[]){tsctl, "-a", tls, "--tls-ca", certs.ca, "peek", "tlsbin", NULL}),
        0);
    assert_true(output_has("1.5"));
    /* A CA that did not sign the server's certificate: refused (TS_EAUTH). */
    assert_int_equal(
        run((const char *const[]){tsctl, "-a", tls, "--tls-ca", certs.other_ca, "ping", NULL}), 1);
    assert_true(output_has("certificate"));
    /* The hint is about the CA, not about a token. */
    assert_true(output_has("did not verify against --tls-ca"));
    assert_false(output_has("token"));
    setenv("TS_TLS_CA", certs.other_ca, 1);
    assert_int_equal(run((const char *const[]){tsctl, "-a", tls, "ping", NULL}), 1);
    assert_true(output_has("did not verify against TS_TLS_CA"));
    assert_true(output_has("--tls-ca FILE"));
    assert_false(output_has("token"));
    unsetenv("TS_TLS_CA");
    /* The library's TS_TLS_CA serves as well. */
    setenv("TS_TLS_CA", certs.ca, 1);
    assert_int_equal(run((const char *const[]){tsctl, "-a", tls, "ping", NULL}), 0);
    unsetenv("TS_TLS_CA");
    /* Plain TCP to the TLS port fails, and says the server closed the connection. */
    assert_int_equal(run((const char *const[]){tsctl, "-p", aux_port, "ping", NULL}), 1);
    assert_int_equal(aux_teardown(NULL), 0);
    /* A list of TLS shards: --tls-ca reaches every shard (stopped before anything is checked). */
    tsc_cluster shards;
    memset(&shards, 0, sizeof(shards));
    int started = tsc_start(&shards, 2, args);
    char tls_list[160];
    snprintf(tls_list, sizeof(tls_list), "tls://%.24s,tls://%.24s", shards.srv[0].addr,
             shards.srv[1].addr);
    int list_rc[3] = {-1, -1, -1}, list_peeked = 0;
    if (started == 0) {
        list_rc[0] =
            run((const char *const[]){tsctl, "-a", tls_list, "--tls-ca", certs.ca, "ping", NULL});
        list_rc[1] = run((const char *const[]){tsctl, "-a", tls_list, "--tls-ca", certs.ca, "put",
                                               "tlslist", "2.5", NULL});
        list_rc[2] = run((const char *const[]){tsctl, "-a", tls_list, "--tls-ca", certs.ca, "peek",
                                               "tlslist", NULL});
        list_peeked = output_has("2.5");
    }
    tsc_stop(&shards);
    assert_int_equal(started, 0);
    assert_int_equal(list_rc[0], 0);
    assert_int_equal(list_rc[1], 0);
    assert_int_equal(list_rc[2], 0);
    assert_true(list_peeked);
    tls_certs_remove(&certs);
#endif
}

/* A server at its client limit closes the connection with TOO_MANY_CLIENTS: tsctl says so. */
static void test_tsctl_server_reason(void **state)
{
    (void)state;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, aux.addr, NULL), 0);
    int rc =
        run((const char *const[]){tsctl, "--port", aux_port, "--timeout", "3000", "ping", NULL});
    ts_client_free(c);
    assert_int_equal(rc, 1);
    assert_true(output_has("too many clients"));
}

/* stats --watch prints samples with rates, --count of them. */
static void test_tsctl_stats_watch(void **state)
{
    (void)state;
    assert_int_equal(TSCTL("stats", "--watch", "0.2", "--count", "2"), 0);
    assert_true(output_has("OPS/S"));
    assert_int_equal(output_count("\n"), 3); /* a header and two samples */
    assert_int_equal(TSCTL("stats", "--watch=0", "--count=2"), 2);
    assert_true(output_has("'0'"));
}

/*
 * stats --watch after a STATS that took several intervals (the server paused): the ticks it let
 * pass are skipped, not printed back to back with rates over microseconds.
 */
static void test_tsctl_stats_watch_pause(void **state)
{
    (void)state;
    child ch = spawn((const char *const[]){tsctl, "--port", port_arg, "stats", "--watch", "0.2",
                                           "--count", "8", NULL});
    tc_sleep_ms(500);
    kill(srv.pid, SIGSTOP);
    tc_sleep_ms(1200);
    kill(srv.pid, SIGCONT);
    assert_int_equal(reap(ch, 30000), 0);
    FILE *f = fopen(out_path, "r");
    assert_non_null(f);
    char line[512];
    double prev_at = -1;
    int samples = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        double at, ops_rate;
        long long ops;
        int got = sscanf(line, "%lf %lld %lf", &at, &ops, &ops_rate);
        if (got < 2)
            continue; /* the header */
        samples++;
        if (prev_at >= 0)
            assert_true(at - prev_at >= 0.1); /* half an interval at least */
        if (got == 3)
            assert_true(ops_rate < 1000.0); /* a few STATS a second */
        prev_at = at;
    }
    fclose(f);
    assert_int_equal(samples, 8);
}

/* --timeout bounds connecting too: a server that does not answer ends tsctl within about it. */
static void test_tsctl_timeout_connect(void **state)
{
    (void)state;
    kill(srv.pid, SIGSTOP); /* the kernel still accepts the connection; the handshake waits */
    uint64_t t0 = tc_now_ms();
    int ping_rc = TSCTL("-t", "500", "ping");
    uint64_t ping_ms = tc_now_ms() - t0;
    int ping_said = output_has("timed out");
    t0 = tc_now_ms();
    int wait_rc = TSCTL("-t", "800", "wait", "b");
    uint64_t wait_ms = tc_now_ms() - t0;
    kill(srv.pid, SIGCONT);
    assert_int_equal(ping_rc, 3);
    assert_true(ping_said);
    assert_true(ping_ms < 3000); /* the library's own connect limit is 5000 */
    assert_int_equal(wait_rc, 3);
    assert_true(wait_ms < 3000);
    assert_int_equal(TSCTL("ping"), 0);
}

/* Every example prints its usage on --help (exit 0) and on a bad argument (exit 2). */
static void test_examples_usage(void **state)
{
    (void)state;
    assert_int_equal(run((const char *const[]){quickstart, "--help", NULL}), 0);
    assert_true(output_has("usage:"));
    assert_false(output_has("connecting failed"));
    assert_int_equal(run((const char *const[]){quickstart, "-h", NULL}), 0);
    assert_true(output_has("usage:"));
    assert_int_equal(run((const char *const[]){quickstart, "--frob", NULL}), 2);
    assert_true(output_has("usage:"));
    assert_int_equal(run((const char *const[]){quickstart, "a:1", "b:2", NULL}), 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_quickstart),
        cmocka_unit_test(test_npy_and_literals),
        cmocka_unit_test(test_tsctl_commands),
        cmocka_unit_test(test_tsctl_listen_count),
        cmocka_unit_test(test_tsctl_get_out_keeps_items),
        cmocka_unit_test(test_tsctl_options),
        cmocka_unit_test(test_tsctl_list_escapes),
        cmocka_unit_test(test_tsctl_address),
        cmocka_unit_test_setup_teardown(test_tsctl_auth_errors, auth_setup, aux_teardown),
        cmocka_unit_test_setup_teardown(test_tsctl_server_reason, full_setup, aux_teardown),
        cmocka_unit_test(test_tsctl_stats_watch),
        cmocka_unit_test(test_tsctl_stats_watch_pause),
        cmocka_unit_test(test_tsctl_timeout_connect),
        cmocka_unit_test(test_examples_usage),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
