/*
 * The coordination primitives against a real tensord (include/tensorshare/coord.h): counters
 * that many processes add to at once and that end at the exact sum, compare-and-set under
 * contention with exactly one winner per version, takers served first come first served with
 * each item given once, MGET of present and missing bins, a barrier of 64 processes used twice,
 * and bad input (ADD on a bin that is not a counter, overflow, names of streams, a barrier of 0
 * parties or of mismatched parties, malformed bodies as raw frames) refused with a clear error
 * and nothing changed.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>

#include <cmocka.h>

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "msg.h"
#include "tensorshare/coord.h"
#include "tensorshare/replay.h"
#include "tensorshare/stream.h"
#include "test_client_util.h"

/*
 * The contended counter: ADDERS processes of ADDS_EACH adds each. Each process pipelines its
 * adds through ADD_THREADS threads sharing its client, so that the test takes a few seconds on
 * two cores (TS_COORD_ADDS_EACH raises the count, e.g. to 10000 as the benchmark does).
 */
#define ADDERS      64
#define ADDS_EACH   1000
#define ADD_THREADS 4
/* threads racing for each version in the compare-and-set test, and the versions they race for */
#define CAS_WRITERS 8
#define CAS_ROUNDS  200
/* competing takers, and the items each takes one at a time */
#define TAKERS     16
#define TAKES_EACH 20
/* processes meeting at the barrier */
#define BARRIER_PARTIES 64
/* ms; a wait that must not run out while the test runs */
#define LONG_MS 20000

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

/* The int a counter bin holds, read with PEEK; asserts that it is one int record. */
static int64_t peek_counter(const char *name, uint64_t *version)
{
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(cl, name, 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    int64_t v = 0;
    assert_int_equal(ts_value_int(ts_items_at(items, 0), &v), 0);
    if (version != NULL)
        *version = ts_items_version(items);
    ts_items_free(items);
    return v;
}

/* An item holding one int (the record a counter holds). */
static ts_value_t *int_item(int64_t v)
{
    ts_value_t *it = ts_int_new(v);
    assert_non_null(it);
    return it;
}

static void test_add_basic(void **state)
{
    (void)state;
    int64_t value = 0;
    uint64_t v1 = 0, v2 = 0, pv = 0;
    /* A missing bin starts at 0. */
    assert_int_equal(ts_add(cl, "ctr", 5, &value, &v1), 0);
    assert_true(value == 5 && v1 > 0);
    assert_int_equal(ts_add(cl, "ctr", -7, &value, &v2), 0);
    assert_true(value == -2 && v2 > v1);
    /* A plain bin: PEEK reads it, WAIT sees its version. */
    assert_true(peek_counter("ctr", &pv) == -2 && pv == v2);
    uint64_t wv = 0;
    assert_int_equal(ts_wait(cl, "ctr", v1, 0, &wv, NULL), 0);
    assert_true(wv == v2);
    /* NULL out-parameters are fine; a delta of 0 is a change like any other. */
    assert_int_equal(ts_add(cl, "ctr", 0, NULL, NULL), 0);
    assert_true(peek_counter("ctr", &pv) == -2 && pv > v2);
    /* A counter made by a PUT of an int works too. */
    ts_value_t *it = int_item(INT64_MAX - 1);
    assert_int_equal(ts_put(cl, "ctr_put", it, NULL), 0);
    ts_value_free(it);
    assert_int_equal(ts_add(cl, "ctr_put", 1, &value, NULL), 0);
    assert_true(value == INT64_MAX);
    assert_int_equal(ts_delete(cl, "ctr", NULL), 0);
    assert_int_equal(ts_add(cl, "ctr", 1, &value, NULL), 0);
    assert_true(value == 1);
}

/* ADD on what is not a counter, and past int64: INVALID, and the bin is as it was. */
static void test_add_bad(void **state)
{
    (void)state;
    int64_t value = 42;
    uint64_t before = 0, after = 0;
    /* Two items. */
    ts_value_t *it = int_item(1);
    assert_int_equal(ts_append(cl, "two", it, NULL), 0);
    assert_int_equal(ts_append(cl, "two", it, &before), 0);
    ts_value_free(it);
    assert_int_equal(ts_add(cl, "two", 1, &value, NULL), TS_EINVAL);
    assert_true(value == 42);
    assert_non_null(strstr(ts_last_error(), "ADD on bin 'two': not a counter"));
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(cl, "two", 0, &items), 0);
    assert_true(ts_items_count(items) == 2 && ts_items_version(items) == before);
    ts_items_free(items);
    /* One item whose root is not an int. */
    ts_value_t *f = ts_float_new(1.5);
    assert_int_equal(ts_put(cl, "flt", f, &before), 0);
    ts_value_free(f);
    assert_int_equal(ts_add(cl, "flt", 1, NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_peek(cl, "flt", 0, &items), 0);
    assert_true(ts_items_count(items) == 1 && ts_items_version(items) == before);
    ts_items_free(items);
    /* Overflow, both ways. */
    assert_int_equal(ts_add(cl, "big", INT64_MAX, NULL, &before), 0);
    assert_int_equal(ts_add(cl, "big", 1, NULL, NULL), TS_EINVAL);
    assert_string_equal(ts_last_error(),
                        "ADD of 1 to counter 'big' (9223372036854775807) overflows int64");
    assert_non_null(strstr(ts_last_error(), "overflows"));
    assert_true(peek_counter("big", &after) == INT64_MAX && after == before);
    assert_int_equal(ts_add(cl, "small", INT64_MIN, NULL, NULL), 0);
    assert_int_equal(ts_add(cl, "small", -1, NULL, NULL), TS_EINVAL);
    assert_true(peek_counter("small", NULL) == INT64_MIN);
    /* A stream's name. */
    assert_int_equal(ts_stream_create(cl, "strm", NULL, NULL), 0);
    assert_int_equal(ts_add(cl, "strm", 1, NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_put_if(cl, "strm", 0, f = ts_int_new(1), NULL), TS_EINVAL);
    ts_value_free(f);
    /* Local checks. */
    static char long_name[TS_MAX_NAME_LEN + 2];
    memset(long_name, 'x', sizeof(long_name) - 1);
    assert_int_equal(ts_add(cl, long_name, 1, NULL, NULL), TS_ENAMETOOLONG);
    assert_int_equal(ts_add(cl, NULL, 1, NULL, NULL), TS_EINVAL);
    assert_int_equal(ts_put_if(cl, "x", 0, NULL, NULL), TS_EINVAL);
}

/*
 * The processes of the contended tests run a fresh image of this program (fork, then exec of
 * /proc/self/exe with a role), not a forked copy: a copy of a multi-threaded process may not start
 * threads under ThreadSanitizer, and separate programs are what the tests stand for anyway.
 * Returns the child's pid, or -1.
 */
static pid_t spawn_child(const char *role, int n)
{
    char nbuf[32];
    snprintf(nbuf, sizeof(nbuf), "%d", n);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/proc/self/exe", "test_coord", role, srv.addr, nbuf, (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* One adding process: ADD_THREADS threads sharing a client, n adds of 1 each in all. */
typedef struct adder {
    ts_client_t *c;
    int n;
    int failures;
} adder;

static void *add_thread(void *arg)
{
    adder *a = arg;
    for (int i = 0; i < a->n; i++)
        if (ts_add(a->c, "sum", 1, NULL, NULL) != 0)
            a->failures++;
    return NULL;
}

static int add_process(const char *addr, int n)
{
    ts_client_t *c;
    if (ts_client_open(&c, addr, NULL) != 0)
        return 1;
    adder a[ADD_THREADS];
    pthread_t t[ADD_THREADS];
    for (int i = 0; i < ADD_THREADS; i++) {
        a[i].c = c;
        a[i].n = n / ADD_THREADS + (i < n % ADD_THREADS ? 1 : 0);
        a[i].failures = 0;
        if (pthread_create(&t[i], NULL, add_thread, &a[i]) != 0)
            return 1;
    }
    int failures = 0;
    for (int i = 0; i < ADD_THREADS; i++) {
        pthread_join(t[i], NULL);
        failures += a[i].failures;
    }
    ts_client_free(c);
    return failures == 0 ? 0 : 1;
}

/* ADDERS processes add at once: the counter ends at the exact sum, one version per ADD. */
static void test_add_contended(void **state)
{
    (void)state;
    int each = ADDS_EACH;
    const char *env = getenv("TS_COORD_ADDS_EACH");
    if (env != NULL && strtol(env, NULL, 10) > 0)
        each = (int)strtol(env, NULL, 10);
    uint64_t v0 = 0;
    assert_int_equal(ts_add(cl, "sum", 0, NULL, &v0), 0);
    pid_t pids[ADDERS];
    uint64_t t0 = tc_now_ms();
    for (int i = 0; i < ADDERS; i++) {
        pids[i] = spawn_child("--adder", each);
        assert_true(pids[i] > 0);
    }
    int bad = 0;
    for (int i = 0; i < ADDERS; i++) {
        int st = 0;
        assert_int_equal(waitpid(pids[i], &st, 0), pids[i]);
        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    uint64_t ms = tc_now_ms() - t0;
    assert_int_equal(bad, 0);
    uint64_t v1 = 0;
    int64_t total = peek_counter("sum", &v1);
    assert_true(total == (int64_t)ADDERS * each);
    /* Every ADD took exactly one version (nothing else changed the server meanwhile). */
    assert_true(v1 - v0 == (uint64_t)ADDERS * (uint64_t)each);
    print_message("%d processes x %d adds: %lld in %llu ms\n", ADDERS, each, (long long)total,
                  (unsigned long long)ms);
}

static void test_put_if_basic(void **state)
{
    (void)state;
    ts_value_t *a = int_item(1), *b = int_item(2);
    uint64_t v1 = 0, v2 = 0, cur = 0;
    /* Expected 0: only when the bin does not exist. */
    assert_int_equal(ts_put_if(cl, "cas", 0, a, &v1), 0);
    assert_true(v1 > 0);
    assert_int_equal(ts_put_if(cl, "cas", 0, b, &cur), TS_ECONFLICT);
    assert_true(cur == v1); /* the current version comes back with the refusal */
    assert_non_null(strstr(ts_last_error(), "version"));
    assert_true(peek_counter("cas", NULL) == 1);
    /* The right version wins; a stale one loses and changes nothing. */
    assert_int_equal(ts_put_if(cl, "cas", v1, b, &v2), 0);
    assert_true(v2 > v1 && peek_counter("cas", NULL) == 2);
    cur = 0;
    assert_int_equal(ts_put_if(cl, "cas", v1, a, &cur), TS_ECONFLICT);
    assert_true(cur == v2 && peek_counter("cas", NULL) == 2);
    /* A PUT_IF replaces every item, as PUT does. */
    assert_int_equal(ts_append(cl, "cas", a, &v1), 0);
    assert_int_equal(ts_put_if(cl, "cas", v1, b, &v2), 0);
    assert_true(peek_counter("cas", NULL) == 2);
    /* A missing bin answers with version 0. */
    cur = 99;
    assert_int_equal(ts_put_if(cl, "nobin", 7, a, &cur), TS_ECONFLICT);
    assert_true(cur == 0);
    ts_value_free(a);
    ts_value_free(b);
}

/* Compare-and-set under contention: each thread has its own client. */
typedef struct casw {
    ts_client_t *c;
    int id;
    uint64_t won[CAS_ROUNDS * 2]; /* the expected versions this writer won with */
    int n_won;
    int errors;
} casw;

static volatile int cas_stop;

static void *cas_thread(void *arg)
{
    casw *w = arg;
    while (!cas_stop) {
        ts_items_t *items = NULL;
        if (ts_peek(w->c, "race", 0, &items) != 0) {
            w->errors++;
            return NULL;
        }
        uint64_t v = ts_items_version(items);
        int64_t n = 0;
        (void)ts_value_int(ts_items_at(items, 0), &n);
        ts_items_free(items);
        if (n >= CAS_ROUNDS)
            return NULL;
        ts_value_t *it = ts_int_new(n + 1);
        uint64_t nv = 0;
        int rc = ts_put_if(w->c, "race", v, it, &nv);
        ts_value_free(it);
        if (rc == 0 && w->n_won < (int)TS__ARRAY_SIZE(w->won))
            w->won[w->n_won++] = v;
        else if (rc != 0 && rc != TS_ECONFLICT)
            w->errors++;
    }
    return NULL;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/*
 * CAS_WRITERS threads each read the counter and try to store counter + 1 with the version they
 * read: the counter ends at CAS_ROUNDS exactly, after exactly CAS_ROUNDS wins, and no version
 * was won twice (a lost update would show as a count below the wins or a repeated version).
 */
static void test_put_if_contended(void **state)
{
    (void)state;
    ts_value_t *z = ts_int_new(0);
    assert_int_equal(ts_put(cl, "race", z, NULL), 0);
    ts_value_free(z);
    static casw w[CAS_WRITERS];
    pthread_t t[CAS_WRITERS];
    cas_stop = 0;
    for (int i = 0; i < CAS_WRITERS; i++) {
        memset(&w[i], 0, sizeof(w[i]));
        w[i].id = i;
        assert_int_equal(ts_client_open(&w[i].c, srv.addr, NULL), 0);
        assert_int_equal(pthread_create(&t[i], NULL, cas_thread, &w[i]), 0);
    }
    static uint64_t all[CAS_WRITERS * CAS_ROUNDS * 2];
    size_t n = 0;
    int errors = 0;
    for (int i = 0; i < CAS_WRITERS; i++) {
        pthread_join(t[i], NULL);
        errors += w[i].errors;
        for (int k = 0; k < w[i].n_won; k++)
            all[n++] = w[i].won[k];
        ts_client_free(w[i].c);
    }
    assert_int_equal(errors, 0);
    assert_int_equal(n, CAS_ROUNDS);
    qsort(all, n, sizeof(all[0]), cmp_u64);
    for (size_t i = 1; i < n; i++)
        assert_true(all[i] != all[i - 1]);
    assert_true(peek_counter("race", NULL) == CAS_ROUNDS);
}

/* Malformed bodies as raw frames: BAD_REQUEST, the connection closed, nothing changed. */
static void test_malformed(void **state)
{
    (void)state;
    int64_t before = 0;
    assert_int_equal(ts_add(cl, "raw", 10, &before, NULL), 0);
    uint8_t body[64];
    ts__hdr h;
    uint8_t *rb = NULL;
    size_t rl = 0;
    /* ADD with a delta one byte short, and one byte long. */
    for (int extra = -1; extra <= 1; extra += 2) {
        uint8_t delta[9] = {1, 0, 0, 0, 0, 0, 0, 0, 0};
        size_t len = tsh_name_body(body, sizeof(body), "raw", delta, (size_t)(8 + extra));
        int fd = tsh_connect_tcp(srv.port);
        assert_true(fd >= 0);
        assert_int_equal(tsh_hello(fd), 0);
        assert_int_equal(tsh_send(fd, TS_OP_ADD, 7, body, len), 0);
        assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
        assert_int_equal(h.status, TS_ST_BAD_REQUEST);
        assert_int_equal(h.request_id, 7);
        free(rb);
        assert_int_equal(tsh_wait_closed(fd, 5000), 1);
        close(fd);
    }
    /* PUT_IF whose body ends inside the expected version. */
    uint8_t ver[4] = {0};
    size_t len = tsh_name_body(body, sizeof(body), "raw", ver, sizeof(ver));
    int fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PUT_IF, 8, body, len), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.status, TS_ST_BAD_REQUEST);
    assert_non_null(rb);
    free(rb);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
    /* PUT_IF with a bad record after a good head: BAD_RECORD, nothing stored. */
    uint8_t head[8] = {0};
    uint8_t junk[32];
    memset(junk, 0xAB, sizeof(junk));
    len = tsh_name_body(body, sizeof(body), "raw2", head, sizeof(head));
    memcpy(body + len, junk, sizeof(junk));
    fd = tsh_connect_tcp(srv.port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PUT_IF, 9, body, len + sizeof(junk)), 0);
    assert_int_equal(tsh_recv(fd, &h, &rb, &rl), 0);
    assert_int_equal(h.status, TS_ST_BAD_RECORD);
    free(rb);
    close(fd);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(cl, "raw2", 0, &items), TS_ENOENT);
    assert_true(peek_counter("raw", NULL) == before);
}

/* A raw connection past HELLO. */
static int raw_conn(tsh_server *s)
{
    int fd = tsh_connect_tcp(s->port);
    assert_true(fd >= 0);
    assert_int_equal(tsh_hello(fd), 0);
    return fd;
}

/*
 * Send a request of op with name and two u32 fields (TAKE, BARRIER), then a PING, and wait for
 * the PING's reply: the request has been handled (and is waiting) once it comes.
 */
static void raw_wait_req(int fd, uint8_t op, uint32_t rid, const char *name, uint32_t a,
                         uint32_t timeout_ms)
{
    uint8_t extra[8], body[300];
    ts__put_u32le(extra, a);
    ts__put_u32le(extra + 4, timeout_ms);
    size_t len = tsh_name_body(body, sizeof(body), name, extra, sizeof(extra));
    assert_int_equal(tsh_send(fd, op, rid, body, len), 0);
    assert_int_equal(tsh_send(fd, TS_OP_PING, rid + 1000, NULL, 0), 0);
    ts__hdr h;
    uint8_t *b = NULL;
    size_t bl = 0;
    assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
    assert_int_equal(h.opcode, TS_OP_PING);
    free(b);
}

/* Receive a TAKE's ITEMS reply of one int record on fd; returns the int. */
static int64_t raw_take_one(int fd, uint32_t rid)
{
    ts__hdr h;
    uint8_t *b = NULL;
    size_t bl = 0;
    assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
    assert_int_equal(h.opcode, TS_OP_TAKE);
    assert_int_equal(h.request_id, rid);
    assert_int_equal(h.status, TS_ST_OK);
    ts__msg_items m;
    assert_int_equal(ts__msg_items_decode(b, bl, &m), 0);
    assert_int_equal(m.n_items, 1);
    ts__msg_items_iter it;
    size_t off, rl;
    ts__msg_items_iter_init(&m, &it);
    assert_int_equal(ts__msg_items_next(&m, &it, &off, &rl), 1);
    int64_t v = (int64_t)ts__get_u64le(b + off + 17); /* an int root: type byte, then the i64 */
    free(b);
    return v;
}

/* Takers waiting on one bin are answered in arrival order, one item each, one per item. */
static void test_take_fifo(void **state)
{
    (void)state;
    int fd[3];
    for (int i = 0; i < 3; i++) {
        fd[i] = raw_conn(&srv);
        raw_wait_req(fd[i], TS_OP_TAKE, 10 + (uint32_t)i, "q", 1, LONG_MS);
    }
    for (int64_t v = 0; v < 3; v++) {
        ts_value_t *it = int_item(v);
        assert_int_equal(ts_append(cl, "q", it, NULL), 0);
        ts_value_free(it);
        /* Only the first in line is answered, with that one item. */
        assert_true(raw_take_one(fd[v], 10 + (uint32_t)v) == v);
    }
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(cl, "q", 0, &items), TS_ENOENT);
    /* A DELETE leaves a taker waiting: the next item is still its. */
    raw_wait_req(fd[0], TS_OP_TAKE, 20, "q", 1, LONG_MS);
    assert_int_equal(ts_delete(cl, "q", NULL), 0);
    ts_value_t *it = int_item(7);
    assert_int_equal(ts_append(cl, "q", it, NULL), 0);
    ts_value_free(it);
    assert_true(raw_take_one(fd[0], 20) == 7);
    for (int i = 0; i < 3; i++)
        close(fd[i]);
}

/*
 * A connection that breaks the protocol holds nothing from its error on (PROTOCOL.md section 13),
 * though tensord keeps it open for up to its grace period to write the error: its barrier
 * arrival is withdrawn (a second party arriving is not released with it) and its TAKE no
 * longer takes items.
 */
static void test_erred_connection_withdrawn(void **state)
{
    (void)state;
    int fd = raw_conn(&srv);
    raw_wait_req(fd, TS_OP_BARRIER, 10, "erred-bar", 2, LONG_MS);
    raw_wait_req(fd, TS_OP_TAKE, 11, "erred-q", 1, LONG_MS);
    /* A PING with a body: BAD_REQUEST, and the connection closes (the socket is left open). */
    uint8_t junk = 0;
    assert_int_equal(tsh_send(fd, TS_OP_PING, 12, &junk, 1), 0);
    ts__hdr h;
    uint8_t *b = NULL;
    size_t bl = 0;
    assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
    assert_int_equal(h.request_id, 12);
    assert_int_equal(h.status, TS_ST_BAD_REQUEST);
    free(b);
    /* The other party waits alone: its arrival times out rather than being released. */
    uint64_t gen = 0;
    assert_int_equal(ts_barrier(cl, "erred-bar", 2, 300, &gen), TS_ETIMEDOUT);
    /* An item appended now stays for a live taker. */
    ts_value_t *it = int_item(5);
    assert_int_equal(ts_append(cl, "erred-q", it, NULL), 0);
    ts_value_free(it);
    ts_items_t *items = NULL;
    assert_int_equal(ts_take(cl, "erred-q", 1, LONG_MS, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    ts_items_free(items);
    assert_int_equal(tsh_wait_closed(fd, 10000), 1);
    close(fd);
}

typedef struct taker {
    ts_client_t *c;
    int errors;
    int64_t got[TAKES_EACH];
} taker;

static void *take_thread(void *arg)
{
    taker *t = arg;
    for (int i = 0; i < TAKES_EACH; i++) {
        ts_items_t *items = NULL;
        if (ts_take(t->c, "work", 1, LONG_MS, &items) != 0 || ts_items_count(items) != 1) {
            t->errors++;
            ts_items_free(items);
            continue;
        }
        (void)ts_value_int(ts_items_at(items, 0), &t->got[i]);
        ts_items_free(items);
    }
    return NULL;
}

/* TAKERS threads each take TAKES_EACH items: every item reaches exactly one, nobody retries. */
static void test_take_competing(void **state)
{
    (void)state;
    static taker t[TAKERS];
    pthread_t th[TAKERS];
    for (int i = 0; i < TAKERS; i++) {
        memset(&t[i], 0, sizeof(t[i]));
        assert_int_equal(ts_client_open(&t[i].c, srv.addr, NULL), 0);
        assert_int_equal(pthread_create(&th[i], NULL, take_thread, &t[i]), 0);
    }
    for (int64_t v = 0; v < TAKERS * TAKES_EACH; v++) {
        ts_value_t *it = int_item(v);
        assert_int_equal(ts_append(cl, "work", it, NULL), 0);
        ts_value_free(it);
    }
    static int seen[TAKERS * TAKES_EACH];
    memset(seen, 0, sizeof(seen));
    int errors = 0;
    for (int i = 0; i < TAKERS; i++) {
        pthread_join(th[i], NULL);
        errors += t[i].errors;
        for (int k = 0; k < TAKES_EACH; k++) {
            assert_true(t[i].got[k] >= 0 && t[i].got[k] < TAKERS * TAKES_EACH);
            seen[t[i].got[k]]++;
        }
        ts_client_free(t[i].c);
    }
    assert_int_equal(errors, 0);
    for (int v = 0; v < TAKERS * TAKES_EACH; v++)
        assert_int_equal(seen[v], 1);
}

static void test_take_timeout(void **state)
{
    (void)state;
    ts_items_t *items = NULL;
    assert_int_equal(ts_take(cl, "empty", 0, 0, &items), TS_ETIMEDOUT);
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_take(cl, "empty", 0, 300, &items), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 >= 250);
    assert_int_equal(ts_take(cl, "empty", 0, TS_TIMEOUT_INFINITE, &items), TS_EINVAL);
    /* With items there, 0 does not wait; max_items 0 takes them all. */
    ts_value_t *it = int_item(1);
    assert_int_equal(ts_append(cl, "two_items", it, NULL), 0);
    assert_int_equal(ts_append(cl, "two_items", it, NULL), 0);
    ts_value_free(it);
    assert_int_equal(ts_take(cl, "two_items", 0, 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    ts_items_free(items);
    assert_int_equal(ts_peek(cl, "two_items", 0, &items), TS_ENOENT);
}

static void test_mget(void **state)
{
    (void)state;
    ts_value_t *it = int_item(3);
    assert_int_equal(ts_append(cl, "m_a", it, NULL), 0);
    assert_int_equal(ts_append(cl, "m_a", it, NULL), 0);
    assert_int_equal(ts_put(cl, "m_c", it, NULL), 0);
    ts_value_free(it);
    const char *names[3] = {"m_a", "m_missing", "m_c"};
    ts_items_t *out[3] = {NULL, NULL, NULL};
    assert_int_equal(ts_mget(cl, names, 3, 0, out), 0);
    assert_true(out[0] != NULL && out[1] == NULL && out[2] != NULL);
    assert_int_equal(ts_items_count(out[0]), 2);
    assert_int_equal(ts_items_count(out[2]), 1);
    int64_t v = 0;
    assert_int_equal(ts_value_int(ts_items_at(out[2], 0), &v), 0);
    assert_true(v == 3);
    ts_items_free(out[0]);
    ts_items_free(out[2]);
    /* max_items per bin, and nothing removed. */
    assert_int_equal(ts_mget(cl, names, 3, 1, out), 0);
    assert_int_equal(ts_items_count(out[0]), 1);
    assert_int_equal(ts_items_remaining(out[0]), 2);
    ts_items_free(out[0]);
    ts_items_free(out[2]);
    /* Bounds: 0 names, too many, a body over the control limit. */
    assert_int_equal(ts_mget(cl, names, 0, 0, out), TS_EINVAL);
    assert_int_equal(ts_mget(cl, NULL, 1, 0, out), TS_EINVAL);
    assert_string_equal(ts_last_error(), "MGET needs the names (got NULL)");
    static const char *many[TS_MGET_MAX + 1];
    static char longn[TS_MAX_NAME_LEN + 1];
    memset(longn, 'n', TS_MAX_NAME_LEN);
    for (int i = 0; i <= TS_MGET_MAX; i++)
        many[i] = "m_a";
    static ts_items_t *mout[TS_MGET_MAX + 1];
    assert_int_equal(ts_mget(cl, many, TS_MGET_MAX + 1, 0, mout), TS_EINVAL);
    assert_int_equal(ts_mget(cl, many, TS_MGET_MAX, 1, mout), 0);
    for (int i = 0; i < TS_MGET_MAX; i++)
        ts_items_free(mout[i]);
    for (int i = 0; i < 20; i++)
        many[i] = longn;
    assert_int_equal(ts_mget(cl, many, 20, 0, mout), TS_EMSGSIZE);
    /* A malformed MGET (n = 0) as a raw frame: BAD_REQUEST, closed. */
    uint8_t body[8] = {0};
    int fd = raw_conn(&srv);
    assert_int_equal(tsh_send(fd, TS_OP_MGET, 5, body, sizeof(body)), 0);
    ts__hdr h;
    uint8_t *b = NULL;
    size_t bl = 0;
    assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
    assert_int_equal(h.status, TS_ST_BAD_REQUEST);
    free(b);
    assert_int_equal(tsh_wait_closed(fd, 5000), 1);
    close(fd);
}

/* One barrier process: two generations, each released with the expected number. */
static int barrier_process(const char *addr)
{
    ts_client_t *c;
    if (ts_client_open(&c, addr, NULL) != 0)
        return 1;
    uint64_t g1 = 0, g2 = 0;
    int rc = ts_barrier(c, "meet", BARRIER_PARTIES, LONG_MS, &g1);
    if (rc == 0)
        rc = ts_barrier(c, "meet", BARRIER_PARTIES, LONG_MS, &g2);
    ts_client_free(c);
    return rc == 0 && g1 == 1 && g2 == 2 ? 0 : 1;
}

static void test_barrier(void **state)
{
    (void)state;
    pid_t pids[BARRIER_PARTIES];
    for (int i = 0; i < BARRIER_PARTIES; i++) {
        pids[i] = spawn_child("--barrier", 0);
        assert_true(pids[i] > 0);
    }
    int bad = 0;
    for (int i = 0; i < BARRIER_PARTIES; i++) {
        int st = 0;
        assert_int_equal(waitpid(pids[i], &st, 0), pids[i]);
        bad += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    assert_int_equal(bad, 0);
    /* One party: released at once; the generation goes on. */
    uint64_t g = 0;
    assert_int_equal(ts_barrier(cl, "solo", 1, 0, &g), 0);
    assert_true(g == 1);
    assert_int_equal(ts_barrier(cl, "solo", 1, 0, &g), 0);
    assert_true(g == 2);
}

static void test_barrier_bad(void **state)
{
    (void)state;
    uint64_t g = 0;
    assert_int_equal(ts_barrier(cl, "b0", 0, 0, &g), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "parties"));
    /* A timeout withdraws the arrival: a later pair forms generation 1 on its own. */
    assert_int_equal(ts_barrier(cl, "b2", 2, 200, &g), TS_ETIMEDOUT);
    int fd = raw_conn(&srv);
    raw_wait_req(fd, TS_OP_BARRIER, 30, "b2", 2, LONG_MS);
    /* A mismatched parties count while one waits: INVALID, nothing changed. */
    assert_int_equal(ts_barrier(cl, "b2", 3, 0, &g), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "parties"));
    assert_int_equal(ts_barrier(cl, "b2", 2, LONG_MS, &g), 0);
    assert_true(g == 1);
    ts__hdr h;
    uint8_t *b = NULL;
    size_t bl = 0;
    assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
    assert_true(h.status == TS_ST_OK && h.request_id == 30 && bl == TS_MSG_BARRIER_STATE_SIZE);
    assert_true(ts__get_u64le(b) == 1 && ts__get_u32le(b + 8) == 2);
    free(b);
    close(fd);
}

/*
 * A barrier is kept in the server (its name, its generation) and counts against --max-memory,
 * as its waits do: under a limit that the connection alone already fills, a new barrier is
 * refused OUT_OF_MEMORY, even one of a single party that would be released at once.
 */
static void test_barrier_memory(void **state)
{
    (void)state;
    static const char *const args[] = {"--max-memory", "1", NULL};
    tsh_server small;
    assert_int_equal(tsh_server_start(&small, args), 0);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, small.addr, NULL), 0);
    uint64_t g = 0;
    assert_int_equal(ts_barrier(c, "tiny", 1, 0, &g), TS_EOOM);
    assert_non_null(strstr(ts_last_error(), "memory"));
    assert_int_equal(ts_barrier(c, "tiny", 2, 1000, &g), TS_EOOM);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&small), 0);
    tsh_server_cleanup(&small);
}

/*
 * MGET answers each name as PEEK would: the name of a stream or of a replay table is not a
 * missing bin (PEEK says INVALID, and a PUT to it would fail), so an MGET naming one is INVALID
 * as a whole, naming it, and returns nothing.
 */
static void test_mget_other_kinds(void **state)
{
    (void)state;
    ts_value_t *it = int_item(5);
    assert_int_equal(ts_put(cl, "mk_bin", it, NULL), 0);
    ts_value_free(it);
    assert_int_equal(ts_stream_create(cl, "mk_stream", NULL, NULL), 0);
    ts_table_config_t cfg;
    ts_table_config_init(&cfg);
    cfg.capacity = 4;
    assert_int_equal(ts_table_create(cl, "mk_table", &cfg, NULL), 0);
    ts_items_t *out[3] = {NULL, NULL, NULL};
    const char *with_stream[3] = {"mk_bin", "mk_stream", "mk_nothing"};
    assert_int_equal(ts_mget(cl, with_stream, 3, 0, out), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "mk_stream"));
    assert_true(out[0] == NULL && out[1] == NULL && out[2] == NULL);
    const char *with_table[2] = {"mk_table", "mk_bin"};
    assert_int_equal(ts_mget(cl, with_table, 2, 0, out), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "mk_table"));
    /* Plain and missing bins alone are served as before. */
    const char *plain[2] = {"mk_bin", "mk_nothing"};
    assert_int_equal(ts_mget(cl, plain, 2, 0, out), 0);
    assert_true(out[0] != NULL && out[1] == NULL);
    ts_items_free(out[0]);
}

/* A stopping tensord answers pending TAKEs and barrier arrivals SHUTTING_DOWN. */
static void test_wait_shutdown(void **state)
{
    (void)state;
    tsh_server s2;
    assert_int_equal(tsh_server_start(&s2, NULL), 0);
    int fd = raw_conn(&s2);
    raw_wait_req(fd, TS_OP_TAKE, 40, "q", 1, LONG_MS);
    raw_wait_req(fd, TS_OP_BARRIER, 41, "b", 2, LONG_MS);
    assert_int_equal(kill(s2.pid, SIGTERM), 0);
    int answered = 0;
    for (int i = 0; i < 2; i++) {
        ts__hdr h;
        uint8_t *b = NULL;
        size_t bl = 0;
        assert_int_equal(tsh_recv(fd, &h, &b, &bl), 0);
        free(b);
        answered += h.status == TS_ST_SHUTTING_DOWN && (h.request_id == 40 || h.request_id == 41);
    }
    assert_int_equal(answered, 2);
    close(fd);
    assert_int_equal(tsh_server_stop(&s2), 0);
    tsh_server_cleanup(&s2);
}

/* A STATS counter of the server. */
static int64_t stat_int(const char *key)
{
    ts_value_t *st = NULL;
    assert_int_equal(ts_stats(cl, &st), 0);
    int64_t v = -1;
    assert_int_equal(ts_value_int(ts_map_get(st, key), &v), 0);
    ts_value_free(st);
    return v;
}

/*
 * PUT_IF through a client that compresses its frames: the expected version travels inside the
 * LZ4 body (tensord inflates it and reads the fixed fields there), a large record off the loop.
 */
static void test_put_if_lz4(void **state)
{
    (void)state;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.compress_min = 64;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.addr, &o), 0);
    static float zeros[1 << 18]; /* 1 MiB of zeros: compresses, and is validated off the loop */
    int64_t shape[1] = {1 << 18};
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, shape, zeros, TS_COPY);
    assert_non_null(t);
    uint64_t v1 = 0, v2 = 0, cur = 0;
    int64_t rx0 = stat_int("bytes_received");
    assert_int_equal(ts_put_if(c, "lz", 0, t, &v1), 0);
    /* It went compressed: far fewer bytes than the 1 MiB record arrived. */
    assert_true(stat_int("bytes_received") - rx0 < (1 << 18));
    assert_int_equal(ts_put_if(c, "lz", 0, t, &cur), TS_ECONFLICT);
    assert_true(cur == v1);
    assert_int_equal(ts_put_if(c, "lz", v1, t, &v2), 0);
    assert_true(v2 > v1);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(cl, "lz", 0, &items), 0);
    assert_true(ts_items_count(items) == 1 && ts_items_version(items) == v2);
    ts_items_free(items);
    /* A small one too (inflated on the loop). */
    ts_value_t *small = ts_int_new(5);
    assert_int_equal(ts_put_if(c, "lz_small", 0, small, &v1), 0);
    ts_value_free(small);
    ts_value_free(t);
    ts_client_free(c);
}

int main(int argc, char **argv)
{
    signal(SIGPIPE, SIG_IGN);
    /* A child of the contended tests (spawn_child): role, the server's address, a count. */
    if (argc == 4 && strcmp(argv[1], "--adder") == 0)
        return add_process(argv[2], (int)strtol(argv[3], NULL, 10));
    if (argc == 4 && strcmp(argv[1], "--barrier") == 0)
        return barrier_process(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_add_basic),
        cmocka_unit_test(test_add_bad),
        cmocka_unit_test(test_add_contended),
        cmocka_unit_test(test_put_if_basic),
        cmocka_unit_test(test_put_if_contended),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_take_fifo),
        cmocka_unit_test(test_erred_connection_withdrawn),
        cmocka_unit_test(test_take_competing),
        cmocka_unit_test(test_take_timeout),
        cmocka_unit_test(test_mget),
        cmocka_unit_test(test_barrier),
        cmocka_unit_test(test_barrier_bad),
        cmocka_unit_test(test_wait_shutdown),
        cmocka_unit_test(test_put_if_lz4),
        cmocka_unit_test(test_barrier_memory),
        cmocka_unit_test(test_mget_other_kinds),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
