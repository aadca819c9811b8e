/*
 * libtensorshare against a real tensord: every public call in its blocking and asynchronous
 * form, the original's semantics case by case, subscriptions, records of every kind, DLPack,
 * lz4, and the callback rules (exactly once, never inside the queuing call, TS_EDEADLK).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>

#include "harness.h"
#include "test_client_util.h"
#include "tensorshare/dlpack.h"

static tsh_server srv;
static ts_client_t *cl;

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    return ts_client_open(&cl, srv.addr, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------------------------------------
 * Async plumbing: each callback records its status and result into a slot, then counts down.
 */
typedef struct slot {
    tc_latch done;
    int calls;
    int status;
    uint64_t version;
    uint32_t n_items;
    ts_items_t *items;
    ts_bin_list_t *bins;
    ts_value_t *value;
    char message[256];
    int on_caller_thread;
} slot;

static _Thread_local int inside_call; /* set while a test thread is inside an async call */

static void slot_init(slot *s)
{
    memset(s, 0, sizeof(*s));
    tc_latch_init(&s->done);
}

static void slot_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    slot *s = arg;
    pthread_mutex_lock(&s->done.mu);
    s->calls++;
    s->status = status;
    s->version = res->version;
    s->n_items = res->n_items;
    s->items = res->items;
    res->items = NULL; /* keep */
    s->bins = res->bins;
    res->bins = NULL;
    s->value = res->value;
    res->value = NULL;
    snprintf(s->message, sizeof(s->message), "%s", status < 0 ? ts_last_error() : "");
    s->on_caller_thread = inside_call;
    pthread_mutex_unlock(&s->done.mu);
    tc_latch_add(&s->done, 1);
}

/* Wait for the callback; returns its status. */
static int slot_wait(slot *s)
{
    assert_int_equal(tc_latch_wait(&s->done, 1, TC_WAIT_MS), 1);
    pthread_mutex_lock(&s->done.mu);
    int st = s->status;
    assert_int_equal(s->calls, 1);
    assert_int_equal(s->on_caller_thread, 0);
    pthread_mutex_unlock(&s->done.mu);
    return st;
}

static void slot_free(slot *s)
{
    ts_items_free(s->items);
    ts_bin_list_free(s->bins);
    ts_value_free(s->value);
    tc_latch_destroy(&s->done);
}

/* ---------------------------------------------------------------------------------------------
 * Opening
 */

static void test_open_rejects_bad_addresses(void **state)
{
    (void)state;
    /*
     * Another scheme is not a host name to resolve, and no host holds '/', '[', ']' or a blank
     * ("[h1:p1,h2:p2]:8000", from wrapping a shard list as a host, is a list of two bad ones).
     */
    static const char *const bad[] = {"",
                                      "nohost",
                                      "host:",
                                      ":80",
                                      "host:0",
                                      "host:70000",
                                      "host:8x",
                                      "unix:",
                                      "[::1:80",
                                      "http://127.0.0.1:80",
                                      "udp://127.0.0.1:80",
                                      "tls://unix:/tmp/x.sock",
                                      "a/b:80",
                                      "a]:80",
                                      "a b:80",
                                      "[x,y]:1",
                                      "[127.0.0.1:1,127.0.0.1:2]:8000"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        ts_client_t *c = NULL;
        int rc = ts_client_open(&c, bad[i], NULL);
        if (rc != TS_EINVAL)
            fail_msg("'%s': %s (%s), expected TS_EINVAL", bad[i], ts_err_name(rc), ts_last_error());
        assert_non_null(strstr(ts_last_error(), "malformed address"));
        assert_null(c);
    }
    ts_client_t *c;
    assert_int_equal(ts_client_open(NULL, srv.addr, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "out is NULL"));
    assert_int_equal(ts_client_open(&c, NULL, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "needs an address"));
}

static void test_open_every_address_form(void **state)
{
    (void)state;
    char addr[400];
    const char *forms[4];
    char tcp[80], hostname[80], unix2[400];
    snprintf(tcp, sizeof(tcp), "tcp://127.0.0.1:%d", srv.port);
    snprintf(hostname, sizeof(hostname), "localhost:%d", srv.port);
    snprintf(unix2, sizeof(unix2), "unix://%s", srv.unix_path);
    snprintf(addr, sizeof(addr), "%s", srv.unix_addr);
    forms[0] = tcp;
    forms[1] = hostname;
    forms[2] = addr;
    forms[3] = unix2;
    for (int i = 0; i < 4; i++) {
        ts_client_t *c;
        int rc = ts_client_open(&c, forms[i], NULL);
        if (rc != 0)
            fail_msg("open %s: %s", forms[i], ts_strerror(rc));
        assert_int_equal(ts_client_connected(c), 1);
        assert_int_equal(ts_ping(c), 0);
        ts_client_free(c);
    }
    ts_client_free(NULL);
    assert_int_equal(ts_client_connected(NULL), 0);
}

/* ---------------------------------------------------------------------------------------------
 * The original's semantics, blocking
 */

static void test_put_replaces_append_adds(void **state)
{
    (void)state;
    uint64_t v1, v2, v3;
    ts_value_t *a = tc_item(4, 1, 1), *b = tc_item(3, 10, 2), *d = tc_item(2, 20, 3);
    assert_int_equal(ts_put(cl, "sem/a", a, &v1), 0);
    assert_int_equal(ts_put(cl, "sem/a", b, &v2), 0); /* replaces */
    assert_true(v2 > v1);
    assert_int_equal(ts_append(cl, "sem/a", d, &v3), 0);
    assert_true(v3 > v2);

    ts_items_t *items;
    assert_int_equal(ts_peek(cl, "sem/a", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    assert_int_equal(ts_items_version(items), v3);
    assert_int_equal(ts_items_remaining(items), 2);
    assert_int_equal(tc_tag(ts_items_at(items, 0)), 2);
    assert_true(tc_check_vec(ts_items_at(items, 0), 3, 10));
    assert_int_equal(tc_tag(ts_items_at(items, 1)), 3);
    assert_true(tc_check_vec(ts_items_at(items, 1), 2, 20));
    assert_null(ts_items_at(items, 2));
    ts_items_free(items);

    /* peek keeps, get removes, a second get is an error (like the original's 550). */
    assert_int_equal(ts_peek(cl, "sem/a", 0, &items), 0);
    ts_items_free(items);
    assert_int_equal(ts_get(cl, "sem/a", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    assert_int_equal(ts_items_remaining(items), 0);
    ts_items_free(items);
    items = NULL;
    assert_int_equal(ts_get(cl, "sem/a", 0, &items), TS_ENOENT);
    assert_null(items);
    assert_true(strlen(ts_last_error()) > 0);
    assert_int_equal(ts_peek(cl, "sem/a", 0, &items), TS_ENOENT);
    /* A successful call clears the message. */
    assert_int_equal(ts_ping(cl), 0);
    assert_string_equal(ts_last_error(), "");

    /* An append to a missing bin creates it. */
    assert_int_equal(ts_append(cl, "sem/new", a, NULL), 0);
    assert_int_equal(ts_get(cl, "sem/new", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    ts_items_free(items);
    ts_value_free(a);
    ts_value_free(b);
    ts_value_free(d);
}

static void test_get_max_items(void **state)
{
    (void)state;
    for (int i = 0; i < 5; i++) {
        ts_value_t *it = tc_item(1, (float)i, i);
        assert_int_equal(ts_append(cl, "sem/fifo", it, NULL), 0);
        ts_value_free(it);
    }
    ts_items_t *items;
    assert_int_equal(ts_peek(cl, "sem/fifo", 2, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    assert_int_equal(ts_items_remaining(items), 5);
    ts_items_free(items);
    assert_int_equal(ts_get(cl, "sem/fifo", 2, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    assert_int_equal(tc_tag(ts_items_at(items, 0)), 0); /* oldest first */
    assert_int_equal(tc_tag(ts_items_at(items, 1)), 1);
    assert_int_equal(ts_items_remaining(items), 3);
    ts_items_free(items);
    assert_int_equal(ts_get(cl, "sem/fifo", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 3);
    assert_int_equal(tc_tag(ts_items_at(items, 2)), 4);
    ts_items_free(items);
}

static void test_delete_and_list(void **state)
{
    (void)state;
    uint32_t n = 99;
    assert_int_equal(ts_delete(cl, "sem/missing", &n), 0); /* silent no-op */
    assert_int_equal(n, 0);
    ts_value_t *it = tc_item(8, 0, 0);
    assert_int_equal(ts_put(cl, "list/b", it, NULL), 0);
    assert_int_equal(ts_append(cl, "list/b", it, NULL), 0);
    assert_int_equal(ts_put(cl, "list/a", it, NULL), 0);
    ts_bin_list_t *list;
    assert_int_equal(ts_list(cl, &list), 0);
    int seen = 0;
    for (size_t i = 0; i < list->count; i++) {
        if (i > 0)
            assert_true(strcmp(list->bins[i - 1].name, list->bins[i].name) < 0);
        if (strcmp(list->bins[i].name, "list/a") == 0) {
            assert_int_equal(list->bins[i].n_items, 1);
            assert_true(list->bins[i].bytes >= ts_value_encoded_size(it));
            seen |= 1;
        }
        if (strcmp(list->bins[i].name, "list/b") == 0) {
            assert_int_equal(list->bins[i].n_items, 2);
            assert_true(list->bins[i].version > 0);
            seen |= 2;
        }
    }
    assert_int_equal(seen, 3);
    ts_bin_list_free(list);
    assert_int_equal(ts_delete(cl, "list/b", &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(ts_delete(cl, "list/a", NULL), 0);
    assert_int_equal(ts_list(cl, &list), 0);
    for (size_t i = 0; i < list->count; i++)
        assert_true(strncmp(list->bins[i].name, "list/", 5) != 0);
    ts_bin_list_free(list);
    ts_value_free(it);
}

static void test_bad_arguments(void **state)
{
    (void)state;
    char name[300];
    memset(name, 'n', 256);
    name[256] = '\0';
    ts_value_t *it = tc_item(1, 0, 0);
    ts_items_t *items;
    assert_int_equal(ts_put(cl, name, it, NULL), TS_ENAMETOOLONG);
    assert_int_equal(ts_get(cl, name, 0, &items), TS_ENAMETOOLONG);
    name[255] = '\0'; /* 255 bytes is the longest name */
    assert_int_equal(ts_put(cl, name, it, NULL), 0);
    assert_int_equal(ts_delete(cl, name, NULL), 0);
    /* Each refusal says what is missing (tensorshare.h, "Error messages"). */
#define REFUSED(call, code, words)                                                                 \
    do {                                                                                           \
        ts_set_last_error("");                                                                     \
        assert_int_equal((call), (code));                                                          \
        if (strstr(ts_last_error(), (words)) == NULL)                                              \
            fail_msg("%s: message '%s', expected '%s' in it", #call, ts_last_error(), (words));    \
    } while (0)
    REFUSED(ts_put(cl, NULL, it, NULL), TS_EINVAL, "PUT needs a bin name");
    REFUSED(ts_put(cl, "x", NULL, NULL), TS_EINVAL, "PUT needs an item");
    REFUSED(ts_append(cl, "x", NULL, NULL), TS_EINVAL, "APPEND needs an item");
    REFUSED(ts_put(NULL, "x", it, NULL), TS_EINVAL, "no client");
    REFUSED(ts_get(cl, "x", 0, NULL), TS_EINVAL, "GET needs an out pointer");
    REFUSED(ts_get(cl, NULL, 0, &items), TS_EINVAL, "GET needs a bin name");
    REFUSED(ts_peek(cl, "x", 0, NULL), TS_EINVAL, "PEEK needs an out pointer");
    REFUSED(ts_delete(cl, NULL, NULL), TS_EINVAL, "DELETE needs a bin name");
    REFUSED(ts_list(cl, NULL), TS_EINVAL, "LIST needs an out pointer");
    REFUSED(ts_stats(cl, NULL), TS_EINVAL, "STATS needs an out pointer");
    REFUSED(ts_wait(cl, NULL, 0, 10, NULL, NULL), TS_EINVAL, "WAIT needs a bin name");
    REFUSED(ts_put_async(cl, "x", NULL, 0, slot_cb, NULL), TS_EINVAL, "PUT needs an item");
    REFUSED(ts_get_async(cl, NULL, 0, slot_cb, NULL), TS_EINVAL, "GET needs a bin name");
    REFUSED(ts_delete_async(cl, NULL, slot_cb, NULL), TS_EINVAL, "DELETE needs a bin name");
    REFUSED(ts_wait_async(cl, NULL, 0, 10, slot_cb, NULL), TS_EINVAL, "WAIT needs a bin name");
    REFUSED(ts_listen(cl, "x", NULL, NULL), TS_EINVAL, "LISTEN needs a callback");
    REFUSED(ts_unlisten(cl, NULL), TS_EINVAL, "UNLISTEN needs a bin name");
    REFUSED(ts_unlisten(cl, "never-listened"), TS_ENOENT, "does not listen to 'never-listened'");
    /* A record nested past TS_MAX_DEPTH says so. */
    ts_value_t *deep = ts_map_new(), *cur = deep;
    for (int i = 0; i < TS_MAX_DEPTH; i++) {
        ts_value_t *next = ts_map_new();
        assert_int_equal(ts_map_set(cur, "d", next), 0);
        cur = next;
    }
    REFUSED(ts_put(cl, "x", deep, NULL), TS_EINVAL, "nested deeper than 32 levels");
    ts_value_free(deep);
#undef REFUSED
    ts_value_free(it);
}

static void test_record_of_every_kind(void **state)
{
    (void)state;
    ts_value_t *root = ts_map_new();
    uint8_t raw[300];
    for (size_t i = 0; i < sizeof(raw); i++)
        raw[i] = (uint8_t)(i * 13);
    for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
        int64_t shape[2] = {3, 5};
        size_t n = 15 * ts_dtype_size((ts_dtype_t)dt);
        ts_value_t *t = ts_tensor_alloc((ts_dtype_t)dt, 2, shape);
        memcpy((void *)ts_value_tensor(t)->data, raw, n);
        if (dt == TS_BOOL)
            memset((void *)ts_value_tensor(t)->data, 1, n);
        assert_int_equal(ts_map_set(root, ts_dtype_name((ts_dtype_t)dt), t), 0);
    }
    ts_value_t *list = ts_list_new();
    assert_int_equal(ts_list_push(list, ts_int_new(-42)), 0);
    assert_int_equal(ts_list_push(list, ts_float_new(2.5)), 0);
    assert_int_equal(ts_list_push(list, ts_string_new("hello", 5)), 0);
    assert_int_equal(ts_list_push(list, ts_bytes_new(raw, 7, TS_BORROW)), 0);
    int64_t empty_shape[1] = {0};
    assert_int_equal(ts_list_push(list, ts_tensor_new(TS_INT32, 1, empty_shape, NULL, 0)), 0);
    assert_int_equal(ts_list_push(list, ts_tensor_new(TS_FLOAT64, 0, NULL, raw, TS_COPY)), 0);
    assert_int_equal(ts_map_set(root, "list", list), 0);
    ts_value_t *deep = ts_map_new();
    ts_value_t *cur = deep;
    for (int i = 0; i < 10; i++) {
        ts_value_t *next = ts_map_new();
        assert_int_equal(ts_map_set(cur, "d", next), 0);
        cur = next;
    }
    assert_int_equal(ts_map_set(cur, "leaf", ts_int_new(7)), 0);
    assert_int_equal(ts_map_set(root, "deep", deep), 0);

    assert_int_equal(ts_put(cl, "kinds", root, NULL), 0);
    ts_items_t *items;
    assert_int_equal(ts_get(cl, "kinds", 0, &items), 0);
    const ts_value_t *got = ts_items_at(items, 0);
    assert_int_equal(ts_value_type(got), TS_TYPE_MAP);
    assert_int_equal(ts_value_len(got), ts_value_len(root));
    for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
        const char *key = ts_dtype_name((ts_dtype_t)dt);
        const ts_tensor_t *a = ts_map_get_tensor(root, key);
        const ts_tensor_t *b = ts_map_get_tensor(got, key);
        assert_non_null(b);
        assert_int_equal(b->dtype, dt);
        assert_int_equal(b->ndim, 2);
        assert_int_equal(b->shape[0], 3);
        assert_int_equal(b->shape[1], 5);
        assert_int_equal((uintptr_t)b->data % 64, 0); /* zero-copy into an aligned buffer */
        assert_memory_equal(a->data, b->data, ts_tensor_nbytes(a));
    }
    const ts_value_t *gl = ts_map_get(got, "list");
    assert_int_equal(ts_value_len(gl), 6);
    int64_t i64;
    double d;
    const char *s;
    size_t len;
    const void *bytes;
    assert_int_equal(ts_value_int(ts_list_at(gl, 0), &i64), 0);
    assert_int_equal(i64, -42);
    assert_int_equal(ts_value_float(ts_list_at(gl, 1), &d), 0);
    assert_true(d == 2.5);
    assert_int_equal(ts_value_string(ts_list_at(gl, 2), &s, &len), 0);
    assert_int_equal(len, 5);
    assert_string_equal(s, "hello");
    assert_int_equal(ts_value_bytes(ts_list_at(gl, 3), &bytes, &len), 0);
    assert_int_equal(len, 7);
    assert_memory_equal(bytes, raw, 7);
    assert_int_equal(ts_value_tensor(ts_list_at(gl, 4))->shape[0], 0);
    assert_int_equal(ts_value_tensor(ts_list_at(gl, 5))->ndim, 0);
    const ts_value_t *g = ts_map_get(got, "deep");
    for (int i = 0; i < 10; i++)
        g = ts_map_get(g, "d");
    assert_int_equal(ts_map_get_int(g, "leaf", &i64), 0);
    assert_int_equal(i64, 7);

    /* A clone of a received value outlives the items. */
    ts_value_t *copy = ts_value_clone(got);
    ts_items_free(items);
    assert_int_equal(ts_value_len(copy), ts_value_len(root));
    assert_memory_equal(ts_map_get_tensor(copy, "float32")->data,
                        ts_map_get_tensor(root, "float32")->data, 15 * 4);
    ts_value_free(copy);
    ts_value_free(root);
}

static void test_large_tensor(void **state)
{
    (void)state;
    int64_t n = 4 << 20; /* 16 MiB of float32: bodies read straight into their buffer */
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, &n);
    float *f = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < n; i++)
        f[i] = (float)(i % 1000) * 0.5f;
    assert_int_equal(ts_put(cl, "large", t, NULL), 0);
    ts_items_t *items;
    assert_int_equal(ts_get(cl, "large", 0, &items), 0);
    const ts_tensor_t *g = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(g);
    assert_int_equal(g->shape[0], n);
    assert_memory_equal(g->data, f, (size_t)n * 4);
    ts_items_free(items);
    ts_value_free(t);
}

static void test_stats_and_ping(void **state)
{
    (void)state;
    assert_int_equal(ts_ping(cl), 0);
    ts_value_t *stats;
    assert_int_equal(ts_stats(cl, &stats), 0);
    assert_int_equal(ts_value_type(stats), TS_TYPE_MAP);
    int64_t n;
    assert_int_equal(ts_map_get_int(stats, "connections", &n), 0);
    assert_true(n >= 1);
    assert_int_equal(ts_map_get_int(stats, "bins", &n), 0);
    ts_value_free(stats);
}

/* ---------------------------------------------------------------------------------------------
 * Asynchronous forms
 */

static void test_async_every_call(void **state)
{
    (void)state;
    slot s[12];
    for (int i = 0; i < 12; i++)
        slot_init(&s[i]);
    ts_value_t *it = tc_item(16, 5, 77);
    inside_call = 1;
    assert_int_equal(ts_put_async(cl, "async/a", it, 0, slot_cb, &s[0]), 0);
    assert_int_equal(ts_append_async(cl, "async/a", it, TS_COPY, slot_cb, &s[1]), 0);
    assert_int_equal(ts_peek_async(cl, "async/a", 0, slot_cb, &s[2]), 0);
    assert_int_equal(ts_list_async(cl, slot_cb, &s[3]), 0);
    assert_int_equal(ts_stats_async(cl, slot_cb, &s[4]), 0);
    assert_int_equal(ts_ping_async(cl, slot_cb, &s[5]), 0);
    assert_int_equal(ts_get_async(cl, "async/a", 1, slot_cb, &s[6]), 0);
    assert_int_equal(ts_wait_async(cl, "async/a", 0, 1000, slot_cb, &s[7]), 0);
    assert_int_equal(ts_delete_async(cl, "async/a", slot_cb, &s[8]), 0);
    assert_int_equal(ts_get_async(cl, "async/a", 0, slot_cb, &s[9]), 0);
    assert_int_equal(ts_wait_async(cl, "async/nothing", 0, 200, slot_cb, &s[10]), 0);
    assert_int_equal(ts_put_async(cl, "async/b", it, 0, NULL, NULL), 0); /* no callback */
    assert_int_equal(ts_get_async(cl, "async/b", 0, slot_cb, &s[11]), 0);
    inside_call = 0;
    /* Requests on one connection complete in order; check each. */
    assert_int_equal(slot_wait(&s[0]), 0);
    assert_true(s[0].version > 0);
    assert_int_equal(s[0].n_items, 1);
    assert_int_equal(slot_wait(&s[1]), 0);
    assert_int_equal(s[1].n_items, 2);
    assert_int_equal(s[1].version, s[0].version + 1);
    assert_int_equal(slot_wait(&s[2]), 0);
    assert_int_equal(ts_items_count(s[2].items), 2);
    assert_true(tc_check_vec(ts_items_at(s[2].items, 1), 16, 5));
    assert_int_equal(slot_wait(&s[3]), 0);
    assert_non_null(s[3].bins);
    assert_int_equal(slot_wait(&s[4]), 0);
    assert_int_equal(ts_value_type(s[4].value), TS_TYPE_MAP);
    assert_int_equal(slot_wait(&s[5]), 0);
    assert_int_equal(slot_wait(&s[6]), 0);
    assert_int_equal(ts_items_count(s[6].items), 1);
    assert_int_equal(s[6].n_items, 1);
    assert_int_equal(slot_wait(&s[7]), 0); /* the version already passed 0 */
    assert_int_equal(slot_wait(&s[8]), 0);
    assert_int_equal(s[8].n_items, 1);
    assert_int_equal(slot_wait(&s[9]), TS_ENOENT);
    assert_true(strlen(s[9].message) > 0);
    assert_null(s[9].items);
    assert_int_equal(slot_wait(&s[10]), TS_ETIMEDOUT);
    assert_int_equal(s[10].version, 0);
    assert_int_equal(slot_wait(&s[11]), 0);
    assert_int_equal(tc_tag(ts_items_at(s[11].items, 0)), 77);
    for (int i = 0; i < 12; i++)
        slot_free(&s[i]);
    ts_value_free(it);
}

static void test_async_put_borrow_and_copy(void **state)
{
    (void)state;
    int64_t n = 1 << 16;
    float *buf = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        buf[i] = 1.0f;
    /* TS_COPY: the caller may change its memory as soon as the call returns. */
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, &n, buf, TS_BORROW);
    slot s1, s2;
    slot_init(&s1);
    slot_init(&s2);
    assert_int_equal(ts_put_async(cl, "borrow/copy", t, TS_COPY, slot_cb, &s1), 0);
    for (int64_t i = 0; i < n; i++)
        buf[i] = 2.0f;
    /* Without TS_COPY the memory is read until the callback, so it must stay as it is. */
    assert_int_equal(ts_put_async(cl, "borrow/borrow", t, 0, slot_cb, &s2), 0);
    assert_int_equal(slot_wait(&s1), 0);
    assert_int_equal(slot_wait(&s2), 0);
    for (int64_t i = 0; i < n; i++)
        buf[i] = 3.0f;
    ts_items_t *items;
    assert_int_equal(ts_get(cl, "borrow/copy", 0, &items), 0);
    const float *f = ts_value_tensor(ts_items_at(items, 0))->data;
    assert_true(f[0] == 1.0f && f[n - 1] == 1.0f);
    ts_items_free(items);
    assert_int_equal(ts_get(cl, "borrow/borrow", 0, &items), 0);
    f = ts_value_tensor(ts_items_at(items, 0))->data;
    assert_true(f[0] == 2.0f && f[n - 1] == 2.0f);
    ts_items_free(items);
    slot_free(&s1);
    slot_free(&s2);
    ts_value_free(t);
    free(buf);
}

/* ---------------------------------------------------------------------------------------------
 * wait
 */

typedef struct delayed_put {
    const char *bin;
    int delay_ms;
} delayed_put;

static void *delayed_put_main(void *arg)
{
    delayed_put *d = arg;
    tc_sleep_ms(d->delay_ms);
    ts_value_t *it = tc_item(1, 0, 0);
    int rc = ts_put(cl, d->bin, it, NULL);
    ts_value_free(it);
    return (void *)(intptr_t)rc;
}

static void test_wait(void **state)
{
    (void)state;
    uint64_t v = 123;
    uint32_t n = 123;
    /* Nothing happens: TS_ETIMEDOUT with the current state (a missing bin has version 0). */
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_wait(cl, "wait/a", 0, 200, &v, &n), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 >= 150);
    assert_int_equal(v, 0);
    assert_int_equal(n, 0);

    /* A change from another thread wakes the waiter. */
    pthread_t th;
    delayed_put d = {"wait/a", 100};
    pthread_create(&th, NULL, delayed_put_main, &d);
    assert_int_equal(ts_wait(cl, "wait/a", 0, 10000, &v, &n), 0);
    void *ret;
    pthread_join(th, &ret);
    assert_int_equal((intptr_t)ret, 0);
    assert_true(v > 0);
    assert_int_equal(n, 1);
    /* Already past: immediate. */
    uint64_t v2;
    assert_int_equal(ts_wait(cl, "wait/a", v - 1, 10000, &v2, NULL), 0);
    assert_int_equal(v2, v);
    assert_int_equal(ts_delete(cl, "wait/a", NULL), 0);
}

static void test_wait_longer_than_request_timeout(void **state)
{
    (void)state;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 300;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    uint64_t t0 = tc_now_ms();
    uint64_t v = 1;
    /* The wait's own timeout (1 s) counts, not the 300 ms request timeout. */
    assert_int_equal(ts_wait(c, "wait/long", 0, 1000, &v, NULL), TS_ETIMEDOUT);
    uint64_t el = tc_now_ms() - t0;
    assert_true(el >= 900);
    assert_int_equal(v, 0);
    slot s;
    slot_init(&s);
    assert_int_equal(ts_wait_async(c, "wait/long", 0, 800, slot_cb, &s), 0);
    assert_int_equal(slot_wait(&s), TS_ETIMEDOUT);
    slot_free(&s);
    ts_client_free(c);
}

/*
 * The one timeout convention (tensorshare.h "Timeouts") on WAIT: 0 asks once and never waits,
 * TS_TIMEOUT_DEFAULT is the request timeout, other negative values are refused, and the option
 * fields refuse 0. In 0.1, 0 meant the request timeout, so the first wait below took that long.
 */
static void test_wait_timeout_convention(void **state)
{
    (void)state;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 3000;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);

    /* 0: checked once (a bin that does not exist has version 0, so nothing is newer). */
    uint64_t v = 7;
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_wait(c, "wait/conv", 0, 0, &v, NULL), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 < 1500);
    assert_int_equal(v, 0);
    assert_true(strlen(ts_last_error()) > 0);
    slot s;
    slot_init(&s);
    t0 = tc_now_ms();
    assert_int_equal(ts_wait_async(c, "wait/conv", 0, 0, slot_cb, &s), 0);
    assert_int_equal(slot_wait(&s), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 < 1500);
    assert_true(strlen(s.message) > 0); /* set on the I/O thread before the callback */
    slot_free(&s);

    /* 0 when the condition already holds: answered at once with the state. */
    uint64_t put_v = 0;
    ts_value_t *it = ts_int_new(1);
    assert_int_equal(ts_put(c, "wait/conv", it, &put_v), 0);
    ts_value_free(it);
    assert_int_equal(ts_wait(c, "wait/conv", 0, 0, &v, NULL), 0);
    assert_int_equal(v, put_v);

    /* TS_TIMEOUT_DEFAULT: the client's request timeout (3 s here). */
    t0 = tc_now_ms();
    assert_int_equal(ts_wait(c, "wait/conv", put_v, TS_TIMEOUT_DEFAULT, &v, NULL), TS_ETIMEDOUT);
    uint64_t el = tc_now_ms() - t0;
    assert_true(el >= 2500 && el < 6000);

    /* Any other negative value is refused, with a message. */
    assert_int_equal(ts_wait(c, "wait/conv", 0, -5, NULL, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "timeout_ms"));
    assert_int_equal(ts_wait_async(c, "wait/conv", 0, -3, slot_cb, NULL), TS_EINVAL);
    assert_int_equal(ts_delete(c, "wait/conv", NULL), 0);
    ts_client_free(c);

    /* Option fields: positive or TS_TIMEOUT_DEFAULT; 0 and TS_TIMEOUT_INFINITE are refused. */
    ts_client_options_init(&o);
    o.request_timeout_ms = 0;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "request_timeout_ms"));
    o.request_timeout_ms = TS_TIMEOUT_INFINITE;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), TS_EINVAL);
    o.request_timeout_ms = TS_TIMEOUT_DEFAULT;
    o.connect_timeout_ms = TS_TIMEOUT_DEFAULT;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    ts_client_free(c);

    /* The reconnect backoff follows the same rule, and its maximum is not below its minimum. */
    static const int bad_backoff[][2] = {{0, 100},
                                         {-5, 100},
                                         {TS_TIMEOUT_INFINITE, 100},
                                         {20, 0},
                                         {20, -7},
                                         {20, TS_TIMEOUT_INFINITE},
                                         {500, 100},
                                         {5000, TS_TIMEOUT_DEFAULT}}; /* above max's 2000 */
    for (size_t i = 0; i < sizeof(bad_backoff) / sizeof(bad_backoff[0]); i++) {
        ts_client_options_init(&o);
        o.reconnect_min_ms = bad_backoff[i][0];
        o.reconnect_max_ms = bad_backoff[i][1];
        c = NULL;
        assert_int_equal(ts_client_open(&c, srv.addr, &o), TS_EINVAL);
        assert_null(c);
        assert_non_null(strstr(ts_last_error(), "reconnect_m"));
    }
    /* The cluster client checks them too, before it starts any shard. */
    char list[400];
    snprintf(list, sizeof(list), "%s,%s", srv.addr, srv.unix_addr);
    ts_client_options_init(&o);
    o.reconnect_max_ms = 10;
    assert_int_equal(ts_client_open(&c, list, &o), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "reconnect_max_ms 10 is below reconnect_min_ms 50"));
    static const int good_backoff[][2] = {{TS_TIMEOUT_DEFAULT, TS_TIMEOUT_DEFAULT},
                                          {100, 100},
                                          {TS_TIMEOUT_DEFAULT, 50},
                                          {3000, 60000}};
    for (size_t i = 0; i < sizeof(good_backoff) / sizeof(good_backoff[0]); i++) {
        ts_client_options_init(&o);
        o.reconnect_min_ms = good_backoff[i][0];
        o.reconnect_max_ms = good_backoff[i][1];
        assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
        ts_client_free(c);
    }
}

/* ---------------------------------------------------------------------------------------------
 * listen
 */

#define MAX_NOTES 64
typedef struct notes {
    pthread_mutex_t mu;
    int n;
    ts_notification_t got[MAX_NOTES];
    char bins[MAX_NOTES][32];
    int finals;
    int final_status;
    int violations; /* calls that broke the rules (checked by the test thread) */
    tc_latch latch;
} notes;

static void notes_init(notes *ns)
{
    memset(ns, 0, sizeof(*ns));
    pthread_mutex_init(&ns->mu, NULL);
    tc_latch_init(&ns->latch);
}

static void notes_destroy(notes *ns)
{
    assert_int_equal(ns->violations, 0);
    pthread_mutex_destroy(&ns->mu);
    tc_latch_destroy(&ns->latch);
}

static void notes_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    (void)c;
    notes *ns = arg;
    pthread_mutex_lock(&ns->mu);
    if (status != 0) {
        ns->violations += n != NULL;
        ns->finals++;
        ns->final_status = status;
    } else {
        ns->violations += ns->finals != 0; /* nothing after the final call */
        if (ns->n < MAX_NOTES) {
            ns->got[ns->n] = *n;
            snprintf(ns->bins[ns->n], sizeof(ns->bins[0]), "%s", n->bin);
            ns->got[ns->n].bin = ns->bins[ns->n];
        }
        ns->n++;
    }
    pthread_mutex_unlock(&ns->mu);
    tc_latch_add(&ns->latch, 1);
}

static void test_listen_sees_every_change(void **state)
{
    (void)state;
    notes ns;
    notes_init(&ns);
    assert_int_equal(ts_listen(cl, "listen/a", notes_cb, &ns), 0);
    assert_int_equal(ts_listen(cl, "listen/a", notes_cb, &ns), TS_EINVAL); /* one per bin */
    /* Every change right after ts_listen returns is delivered, the writer's own included. */
    ts_value_t *it = tc_item(2, 0, 0);
    uint64_t v[4];
    ts_items_t *items;
    uint32_t removed;
    assert_int_equal(ts_put(cl, "listen/a", it, &v[0]), 0);
    assert_int_equal(ts_append(cl, "listen/a", it, &v[1]), 0);
    assert_int_equal(ts_peek(cl, "listen/a", 0, &items), 0); /* peek is no change */
    ts_items_free(items);
    assert_int_equal(ts_get(cl, "listen/a", 0, &items), 0);
    ts_items_free(items);
    assert_int_equal(ts_append(cl, "listen/a", it, &v[3]), 0);
    assert_int_equal(ts_delete(cl, "listen/a", &removed), 0);
    assert_int_equal(ts_delete(cl, "listen/a", &removed), 0); /* missing: no notification */
    assert_int_equal(tc_latch_wait(&ns.latch, 5, TC_WAIT_MS), 5);
    tc_sleep_ms(100);
    pthread_mutex_lock(&ns.mu);
    assert_int_equal(ns.n, 5);
    static const ts_event_t want[] = {TS_EV_PUT, TS_EV_APPEND, TS_EV_GET, TS_EV_APPEND,
                                      TS_EV_DELETE};
    static const uint32_t counts[] = {1, 2, 0, 1, 0};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ns.got[i].event, want[i]);
        assert_int_equal(ns.got[i].n_items, counts[i]);
        assert_string_equal(ns.got[i].bin, "listen/a");
        if (i > 0)
            assert_true(ns.got[i].version > ns.got[i - 1].version);
    }
    assert_int_equal(ns.got[0].version, v[0]);
    assert_int_equal(ns.got[1].version, v[1]);
    assert_int_equal(ns.got[3].version, v[3]);
    pthread_mutex_unlock(&ns.mu);

    /* unlisten: exactly one final call with TS_ECANCELED, then silence. */
    assert_int_equal(ts_unlisten(cl, "listen/a"), 0);
    assert_int_equal(ts_unlisten(cl, "listen/a"), TS_ENOENT);
    assert_int_equal(tc_latch_wait(&ns.latch, 6, TC_WAIT_MS), 6);
    assert_int_equal(ts_put(cl, "listen/a", it, NULL), 0);
    assert_int_equal(ts_ping(cl), 0);
    tc_sleep_ms(100);
    pthread_mutex_lock(&ns.mu);
    assert_int_equal(ns.finals, 1);
    assert_int_equal(ns.final_status, TS_ECANCELED);
    assert_int_equal(ns.n, 5);
    pthread_mutex_unlock(&ns.mu);

    /* Listening again after unlisten works. */
    notes ns2;
    notes_init(&ns2);
    assert_int_equal(ts_listen(cl, "listen/a", notes_cb, &ns2), 0);
    assert_int_equal(ts_delete(cl, "listen/a", NULL), 0);
    assert_int_equal(tc_latch_wait(&ns2.latch, 1, TC_WAIT_MS), 1);
    assert_int_equal(ts_unlisten(cl, "listen/a"), 0);
    assert_int_equal(tc_latch_wait(&ns2.latch, 2, TC_WAIT_MS), 2);
    assert_int_equal(ns2.got[0].event, TS_EV_DELETE);
    assert_int_equal(ns2.finals, 1);
    notes_destroy(&ns2);
    notes_destroy(&ns);
    ts_value_free(it);
}

/* Two clients: a change by one reaches the other's listener. */
static void test_listen_other_client(void **state)
{
    (void)state;
    ts_client_t *other;
    assert_int_equal(ts_client_open(&other, srv.unix_addr, NULL), 0);
    notes ns;
    notes_init(&ns);
    assert_int_equal(ts_listen(other, "listen/b", notes_cb, &ns), 0);
    ts_value_t *it = tc_item(2, 0, 0);
    assert_int_equal(ts_append(cl, "listen/b", it, NULL), 0);
    assert_int_equal(tc_latch_wait(&ns.latch, 1, TC_WAIT_MS), 1);
    assert_int_equal(ns.got[0].event, TS_EV_APPEND);
    /* Freeing the client ends its subscriptions with a final call. */
    ts_client_free(other);
    assert_int_equal(ns.finals, 1);
    assert_int_equal(ns.final_status, TS_ECANCELED);
    assert_int_equal(ts_delete(cl, "listen/b", NULL), 0);
    notes_destroy(&ns);
    ts_value_free(it);
}

/* ---------------------------------------------------------------------------------------------
 * Callback rules
 */

typedef struct cb_probe {
    tc_latch latch;
    int blocking_rc[4];
    int nested_rc;
    int nested_inside; /* the nested callback ran while the queuing call was still running */
    slot nested;
} cb_probe;

static _Thread_local int io_inside;

static void nested_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    cb_probe *p = arg;
    p->nested_inside = io_inside;
    slot_cb(c, status, res, &p->nested);
}

static void probe_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)status;
    (void)res;
    cb_probe *p = arg;
    ts_items_t *items;
    ts_value_t *it = tc_item(1, 0, 0);
    p->blocking_rc[0] = ts_ping(c);
    p->blocking_rc[1] = ts_get(c, "x", 0, &items);
    p->blocking_rc[2] = ts_put(c, "x", it, NULL);
    p->blocking_rc[3] = ts_listen(c, "x", notes_cb, NULL);
    ts_value_free(it);
    /* Async calls are fine from callbacks, and their callbacks come later. */
    io_inside = 1;
    p->nested_rc = ts_ping_async(c, nested_cb, p);
    io_inside = 0;
    tc_latch_add(&p->latch, 1);
}

static void test_blocking_call_in_callback_is_edeadlk(void **state)
{
    (void)state;
    cb_probe p;
    memset(&p, 0, sizeof(p));
    tc_latch_init(&p.latch);
    slot_init(&p.nested);
    assert_int_equal(ts_ping_async(cl, probe_cb, &p), 0);
    assert_int_equal(tc_latch_wait(&p.latch, 1, TC_WAIT_MS), 1);
    for (int i = 0; i < 4; i++)
        assert_int_equal(p.blocking_rc[i], TS_EDEADLK);
    assert_int_equal(p.nested_rc, 0);
    assert_int_equal(slot_wait(&p.nested), 0);
    assert_int_equal(p.nested_inside, 0);
    slot_free(&p.nested);
    tc_latch_destroy(&p.latch);
}

static void test_free_with_pending_requests(void **state)
{
    (void)state;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    enum { N = 40 };
    slot s[N];
    for (int i = 0; i < N; i++)
        slot_init(&s[i]);
    /* Waits the server holds for 30 s: certainly pending when the client goes. */
    for (int i = 0; i < N; i++) {
        int rc = i % 2 == 0 ? ts_wait_async(c, "pending/x", UINT64_MAX - 1, 30000, slot_cb, &s[i])
                            : ts_ping_async(c, slot_cb, &s[i]);
        assert_int_equal(rc, 0);
    }
    notes ns;
    notes_init(&ns);
    assert_int_equal(ts_listen(c, "pending/x", notes_cb, &ns), 0);
    ts_client_free(c);
    int canceled = 0;
    for (int i = 0; i < N; i++) {
        assert_int_equal(tc_latch_get(&s[i].done), 1); /* every callback ran, exactly once */
        assert_int_equal(s[i].calls, 1);
        if (i % 2 == 0)
            assert_int_equal(s[i].status, TS_ECANCELED);
        canceled += s[i].status == TS_ECANCELED;
        slot_free(&s[i]);
    }
    assert_true(canceled >= N / 2);
    assert_int_equal(ns.finals, 1);
    assert_int_equal(ns.final_status, TS_ECANCELED);
    notes_destroy(&ns);
}

typedef struct self_free {
    tc_latch latch;
    notes ns;
    int after_rc;
} self_free;

static void free_in_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)status;
    (void)res;
    self_free *sf = arg;
    ts_client_free(c);
    /* Still usable until the callback returns, but new requests are refused. */
    sf->after_rc = ts_ping_async(c, slot_cb, NULL);
    tc_latch_add(&sf->latch, 1);
}

static void test_free_from_callback(void **state)
{
    (void)state;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, NULL), 0);
    self_free sf;
    memset(&sf, 0, sizeof(sf));
    tc_latch_init(&sf.latch);
    notes_init(&sf.ns);
    assert_int_equal(ts_listen(c, "selffree", notes_cb, &sf.ns), 0);
    assert_int_equal(ts_ping_async(c, free_in_cb, &sf), 0);
    assert_int_equal(tc_latch_wait(&sf.latch, 1, TC_WAIT_MS), 1);
    assert_int_equal(sf.after_rc, TS_ECANCELED);
    /* The I/O thread finishes the job: the subscription gets its final call. */
    assert_int_equal(tc_latch_wait(&sf.ns.latch, 1, TC_WAIT_MS), 1);
    pthread_mutex_lock(&sf.ns.mu);
    assert_int_equal(sf.ns.finals, 1);
    pthread_mutex_unlock(&sf.ns.mu);
    tc_sleep_ms(100); /* let the detached I/O thread finish freeing */
    notes_destroy(&sf.ns);
    tc_latch_destroy(&sf.latch);
}

/* ---------------------------------------------------------------------------------------------
 * lz4 and DLPack
 */

static int64_t stat_of(const char *key)
{
    ts_value_t *stats;
    int64_t v = -1;
    if (ts_stats(cl, &stats) == 0) {
        ts_map_get_int(stats, key, &v);
        ts_value_free(stats);
    }
    return v;
}

static void test_lz4(void **state)
{
    (void)state;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.compress_min = 4096;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    int64_t n = 1 << 20; /* 4 MiB of a repeating pattern compresses well */
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, &n);
    float *f = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < n; i++)
        f[i] = (float)(i % 16);
    int64_t before = stat_of("bytes_received");
    assert_int_equal(ts_put(c, "lz4/a", t, NULL), 0);
    int64_t after = stat_of("bytes_received");
    if (before >= 0 && after >= 0) {
        printf("lz4: 4 MiB tensor sent as %lld bytes\n", (long long)(after - before));
        assert_true(after - before < n * 4 / 4);
    }
    /* Incompressible data goes raw; small frames are never compressed. */
    int64_t m = 1 << 16;
    ts_value_t *r = ts_tensor_alloc(TS_UINT8, 1, &m);
    uint8_t *rb = ts_value_tensor(r)->data;
    uint32_t x = 1;
    for (int64_t i = 0; i < m; i++) {
        x = x * 1103515245u + 12345u;
        rb[i] = (uint8_t)(x >> 16);
    }
    assert_int_equal(ts_append(c, "lz4/a", r, NULL), 0);
    ts_value_t *small = tc_item(4, 0, 9);
    slot s;
    slot_init(&s);
    assert_int_equal(ts_append_async(c, "lz4/a", small, 0, slot_cb, &s), 0);
    assert_int_equal(slot_wait(&s), 0);
    slot_free(&s);
    ts_items_t *items;
    assert_int_equal(ts_get(c, "lz4/a", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 3);
    assert_memory_equal(ts_value_tensor(ts_items_at(items, 0))->data, f, (size_t)n * 4);
    assert_memory_equal(ts_value_tensor(ts_items_at(items, 1))->data, rb, (size_t)m);
    assert_int_equal(tc_tag(ts_items_at(items, 2)), 9);
    ts_items_free(items);
    ts_value_free(small);
    ts_value_free(r);
    ts_value_free(t);
    ts_client_free(c);
}

typedef struct dl_owner {
    DLManagedTensor mt;
    float data[12];
    int64_t shape[2];
    int64_t strides[2];
    int deleted;
} dl_owner;

static void dl_owner_delete(DLManagedTensor *self)
{
    ((dl_owner *)self->manager_ctx)->deleted++;
}

static void test_dlpack(void **state)
{
    (void)state;
    dl_owner o;
    memset(&o, 0, sizeof(o));
    for (int i = 0; i < 12; i++)
        o.data[i] = (float)i * 1.5f;
    o.shape[0] = 3;
    o.shape[1] = 4;
    o.mt.dl_tensor.data = o.data;
    o.mt.dl_tensor.device.device_type = kDLCPU;
    o.mt.dl_tensor.ndim = 2;
    o.mt.dl_tensor.dtype.code = kDLFloat;
    o.mt.dl_tensor.dtype.bits = 32;
    o.mt.dl_tensor.dtype.lanes = 1;
    o.mt.dl_tensor.shape = o.shape;
    o.mt.manager_ctx = &o;
    o.mt.deleter = dl_owner_delete;

    /* Transposed strides and GPU memory are refused (t stays ours: no deleter call). */
    o.strides[0] = 1;
    o.strides[1] = 3;
    o.mt.dl_tensor.strides = o.strides;
    assert_null(ts_tensor_from_dlpack(&o.mt));
    o.mt.dl_tensor.strides = NULL;
    o.mt.dl_tensor.device.device_type = kDLCUDA;
    assert_null(ts_tensor_from_dlpack(&o.mt));
    o.mt.dl_tensor.device.device_type = kDLCPU;
    assert_int_equal(o.deleted, 0);
    o.strides[0] = 4;
    o.strides[1] = 1;
    o.mt.dl_tensor.strides = o.strides; /* compact strides are fine */

    ts_value_t *v = ts_tensor_from_dlpack(&o.mt);
    assert_non_null(v);
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "w", v), 0);
    assert_int_equal(ts_put(cl, "dl", m, NULL), 0);
    assert_int_equal(o.deleted, 0);
    ts_value_free(m); /* the map owned the value, which owned the DLManagedTensor */
    assert_int_equal(o.deleted, 1);

    ts_items_t *items;
    assert_int_equal(ts_get(cl, "dl", 0, &items), 0);
    DLManagedTensor *out;
    assert_int_equal(ts_value_to_dlpack(ts_items_at(items, 0), &out), TS_ETYPE);
    const ts_value_t *w = ts_map_get(ts_items_at(items, 0), "w");
    assert_int_equal(ts_value_to_dlpack(w, &out), 0);
    ts_items_free(items); /* the DLManagedTensor keeps the receive buffer alive */
    assert_int_equal(out->dl_tensor.ndim, 2);
    assert_int_equal(out->dl_tensor.shape[0], 3);
    assert_int_equal(out->dl_tensor.shape[1], 4);
    assert_int_equal(out->dl_tensor.dtype.code, kDLFloat);
    assert_int_equal(out->dl_tensor.dtype.bits, 32);
    assert_null(out->dl_tensor.strides);
    assert_memory_equal(out->dl_tensor.data, o.data, sizeof(o.data));
    out->deleter(out);

    /* Built values: the DLManagedTensor borrows the value's memory. */
    ts_value_t *b = tc_vec(5, 2);
    assert_int_equal(ts_value_to_dlpack(b, &out), 0);
    assert_ptr_equal(out->dl_tensor.data, ts_value_tensor(b)->data);
    out->deleter(out);
    ts_value_free(b);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_rejects_bad_addresses),
        cmocka_unit_test(test_open_every_address_form),
        cmocka_unit_test(test_put_replaces_append_adds),
        cmocka_unit_test(test_get_max_items),
        cmocka_unit_test(test_delete_and_list),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_record_of_every_kind),
        cmocka_unit_test(test_large_tensor),
        cmocka_unit_test(test_stats_and_ping),
        cmocka_unit_test(test_async_every_call),
        cmocka_unit_test(test_async_put_borrow_and_copy),
        cmocka_unit_test(test_wait),
        cmocka_unit_test(test_wait_longer_than_request_timeout),
        cmocka_unit_test(test_wait_timeout_convention),
        cmocka_unit_test(test_listen_sees_every_change),
        cmocka_unit_test(test_listen_other_client),
        cmocka_unit_test(test_blocking_call_in_callback_is_edeadlk),
        cmocka_unit_test(test_free_with_pending_requests),
        cmocka_unit_test(test_free_from_callback),
        cmocka_unit_test(test_lz4),
        cmocka_unit_test(test_dlpack),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
