/*
 * Same-host zero copy against a real tensord on a unix socket: by-reference get and peek (large
 * items mapped, small ones inline, equal to what was put), the copying fallback over TCP,
 * mappings that outlive their item, shared-buffer puts and appends, writes after a commit
 * refused, the descriptor lane reconnecting after a server restart, the request timeout on the
 * lane, no descriptor leaked, and a child killed while it holds mappings.
 */
#define _GNU_SOURCE /* memfd_create */

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <dirent.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common.h"
#include "harness.h"
#include "msg.h"
#include "record.h"
#include "test_client_util.h"

static tsh_server srv;
static ts_client_t *cl;

/* elements; a float32 tensor of 4 MiB, above tensord's default --shm-min of 1 MiB */
#define BIG_N (1 << 20)
/* elements; a small tensor, sent inline */
#define SMALL_N 16

static int group_setup(void **state)
{
    (void)state;
    if (tsh_server_start(&srv, NULL) != 0)
        return -1;
    return ts_client_open(&cl, srv.unix_addr, NULL) == 0 ? 0 : -1;
}

static int group_teardown(void **state)
{
    (void)state;
    ts_client_free(cl);
    int rc = tsh_server_stop(&srv);
    tsh_server_cleanup(&srv);
    return rc == 0 ? 0 : -1;
}

/* Descriptors open in this process. */
static int count_fds(void)
{
    DIR *d = opendir("/proc/self/fd");
    if (d == NULL)
        return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.')
            n++;
    closedir(d);
    return n - 1; /* the directory's own descriptor */
}

/* Mappings of this process whose file is a memfd the server made (not our shared buffers). */
static int count_server_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (f == NULL)
        return -1;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof(line), f) != NULL)
        if (strstr(line, "/memfd:") != NULL && strstr(line, "tensorshare-shared") == NULL)
            n++;
    fclose(f);
    return n;
}

/* {"x": float32 [n] with x[i] = i * 0.5 + seed, "step": seed} */
static ts_value_t *make_item(int64_t n, int seed)
{
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 1, &n);
    assert_non_null(t);
    float *p = ts_value_tensor(t)->data;
    for (int64_t i = 0; i < n; i++)
        p[i] = (float)i * 0.5f + (float)seed;
    ts_value_t *m = ts_map_new();
    assert_int_equal(ts_map_set(m, "x", t), 0);
    assert_int_equal(ts_map_set(m, "step", ts_int_new(seed)), 0);
    return m;
}

static void check_item(const ts_value_t *v, int64_t n, int seed)
{
    assert_non_null(v);
    const ts_tensor_t *t = ts_map_get_tensor(v, "x");
    assert_non_null(t);
    assert_int_equal(t->dtype, TS_FLOAT32);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->shape[0], n);
    assert_int_equal((uintptr_t)t->data % 64, 0);
    const float *p = t->data;
    for (int64_t i = 0; i < n; i++)
        if (p[i] != (float)i * 0.5f + (float)seed)
            fail_msg("x[%lld] = %f, expected %f", (long long)i, (double)p[i],
                     (double)((float)i * 0.5f + (float)seed));
    int64_t step;
    assert_int_equal(ts_map_get_int(v, "step", &step), 0);
    assert_int_equal(step, seed);
}

static void put_item(ts_client_t *c, const char *bin, int64_t n, int seed, int append)
{
    ts_value_t *v = make_item(n, seed);
    int rc = append ? ts_append(c, bin, v, NULL) : ts_put(c, bin, v, NULL);
    assert_int_equal(rc, 0);
    ts_value_free(v);
}

/* By-reference peek and get of a large and a small item: equal to the put bytes; mapped. */
static void test_ref_large_and_small(void **state)
{
    (void)state;
    int maps0 = count_server_maps();
    put_item(cl, "ref1", BIG_N, 1, 0);
    put_item(cl, "ref1", SMALL_N, 2, 1);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek_ref(cl, "ref1", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    assert_int_equal(ts_items_remaining(items), 2);
    check_item(ts_items_at(items, 0), BIG_N, 1);
    check_item(ts_items_at(items, 1), SMALL_N, 2);
    /* The large item is a mapping of the server's memfd; the small one came inline. */
    assert_int_equal(count_server_maps(), maps0 + 1);
    ts_items_free(items);
    assert_int_equal(count_server_maps(), maps0);

    /* max_items limits as in ts_peek; get removes. */
    assert_int_equal(ts_get_ref(cl, "ref1", 1, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(ts_items_remaining(items), 1);
    check_item(ts_items_at(items, 0), BIG_N, 1);
    ts_items_free(items);
    assert_int_equal(ts_get_ref(cl, "ref1", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(ts_items_remaining(items), 0);
    check_item(ts_items_at(items, 0), SMALL_N, 2);
    ts_items_free(items);
    /* The bin is gone: the error of ts_get, with the lane still usable afterwards. */
    items = NULL;
    assert_int_equal(ts_get_ref(cl, "ref1", 0, &items), TS_ENOENT);
    assert_null(items);
    assert_int_equal(ts_peek_ref(cl, "nosuchbin", 0, &items), TS_ENOENT);
    put_item(cl, "ref1", SMALL_N, 3, 0);
    assert_int_equal(ts_get_ref(cl, "ref1", 0, &items), 0);
    check_item(ts_items_at(items, 0), SMALL_N, 3);
    ts_items_free(items);
    /* Arguments. */
    assert_int_equal(ts_get_ref(NULL, "ref1", 0, &items), TS_EINVAL);
    assert_int_equal(ts_get_ref(cl, NULL, 0, &items), TS_EINVAL);
    assert_int_equal(ts_peek_ref(cl, "ref1", 0, NULL), TS_EINVAL);
}

/* A by-reference get returns at most TS_REF_MAX_ITEMS items; remaining tells the rest. */
static void test_ref_max_items(void **state)
{
    (void)state;
    for (int i = 0; i < TS_REF_MAX_ITEMS + 3; i++)
        put_item(cl, "many", 4, i, 1);
    ts_items_t *items;
    assert_int_equal(ts_get_ref(cl, "many", 0, &items), 0);
    assert_int_equal(ts_items_count(items), TS_REF_MAX_ITEMS);
    assert_int_equal(ts_items_remaining(items), 3);
    for (int i = 0; i < TS_REF_MAX_ITEMS; i++)
        check_item(ts_items_at(items, (size_t)i), 4, i);
    ts_items_free(items);
    assert_int_equal(ts_get_ref(cl, "many", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 3);
    ts_items_free(items);
}

/* Over TCP the same calls copy (ts_get, ts_peek) with the same results. */
static void test_ref_fallback_tcp(void **state)
{
    (void)state;
    ts_client_t *tcp;
    assert_int_equal(ts_client_open(&tcp, srv.addr, NULL), 0);
    int maps0 = count_server_maps();
    put_item(tcp, "tcpref", BIG_N, 4, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(tcp, "tcpref", 0, &items), 0);
    assert_int_equal(count_server_maps(), maps0); /* copied, not mapped */
    check_item(ts_items_at(items, 0), BIG_N, 4);
    ts_items_free(items);
    assert_int_equal(ts_get_ref(tcp, "tcpref", 0, &items), 0);
    check_item(ts_items_at(items, 0), BIG_N, 4);
    ts_items_free(items);
    /* A shared buffer put over TCP is an ordinary put of its record. */
    int64_t n = SMALL_N;
    ts_value_t *layout = ts_map_new();
    assert_int_equal(ts_map_set(layout, "x", ts_tensor_spec_new(TS_FLOAT32, 1, &n)), 0);
    assert_int_equal(ts_map_set(layout, "step", ts_int_new(5)), 0);
    ts_shared_t *sh;
    assert_int_equal(ts_shared_new(layout, &sh), 0);
    ts_value_free(layout);
    float *x = ts_map_get_tensor(ts_shared_value(sh), "x")->data;
    for (int i = 0; i < SMALL_N; i++)
        x[i] = (float)i * 0.5f + 5.0f;
    assert_int_equal(ts_shared_put(tcp, "tcpref", sh, NULL), 0);
    assert_null(ts_shared_value(sh));
    ts_shared_free(sh);
    assert_int_equal(ts_get(tcp, "tcpref", 0, &items), 0);
    check_item(ts_items_at(items, 0), SMALL_N, 5);
    ts_items_free(items);
    ts_client_free(tcp);
}

/* A mapping stays valid after its item has left the bin (deleted, replaced). */
static void test_ref_mapping_outlives_item(void **state)
{
    (void)state;
    put_item(cl, "outlive", BIG_N, 6, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(cl, "outlive", 0, &items), 0);
    assert_int_equal(ts_delete(cl, "outlive", NULL), 0);
    put_item(cl, "outlive", BIG_N, 7, 0); /* may reuse the server's memory */
    check_item(ts_items_at(items, 0), BIG_N, 6);
    ts_items_free(items);
    assert_int_equal(ts_delete(cl, "outlive", NULL), 0);
}

/* {"x": float32 [rows, 1024] spec, "step": step, "tag": "shared", "blob": 3 bytes} */
static ts_shared_t *new_shared(int64_t rows, int step)
{
    int64_t shape[2] = {rows, 1024};
    ts_value_t *layout = ts_map_new();
    assert_int_equal(ts_map_set(layout, "x", ts_tensor_spec_new(TS_FLOAT32, 2, shape)), 0);
    assert_int_equal(ts_map_set(layout, "step", ts_int_new(step)), 0);
    assert_int_equal(ts_map_set(layout, "tag", ts_string_new("shared", 6)), 0);
    assert_int_equal(ts_map_set(layout, "blob", ts_bytes_new("abc", 3, TS_COPY)), 0);
    ts_shared_t *sh = NULL;
    assert_int_equal(ts_shared_new(layout, &sh), 0);
    assert_int_equal(ts_shared_size(sh), ts_value_encoded_size(layout));
    ts_value_free(layout);
    const ts_tensor_t *t = ts_map_get_tensor(ts_shared_value(sh), "x");
    assert_non_null(t);
    assert_int_equal(t->shape[0], rows);
    assert_int_equal(t->shape[1], 1024);
    float *x = t->data;
    for (int64_t i = 0; i < rows * 1024; i++) {
        assert_true(x[i] == 0.0f); /* starts zeroed */
        x[i] = (float)(i + step);
    }
    return sh;
}

static void check_shared(const ts_value_t *v, int64_t rows, int step)
{
    const ts_tensor_t *t = ts_map_get_tensor(v, "x");
    assert_non_null(t);
    assert_int_equal(t->shape[0], rows);
    const float *x = t->data;
    for (int64_t i = 0; i < rows * 1024; i++)
        if (x[i] != (float)(i + step))
            fail_msg("x[%lld] = %f", (long long)i, (double)x[i]);
    int64_t s;
    assert_int_equal(ts_map_get_int(v, "step", &s), 0);
    assert_int_equal(s, step);
    const char *str;
    size_t len;
    assert_int_equal(ts_value_string(ts_map_get(v, "tag"), &str, &len), 0);
    assert_int_equal(len, 6);
    assert_memory_equal(str, "shared", 6);
    const void *b;
    assert_int_equal(ts_value_bytes(ts_map_get(v, "blob"), &b, &len), 0);
    assert_int_equal(len, 3);
    assert_memory_equal(b, "abc", 3);
}

/* A server that refuses descriptors (--no-fds): the same calls copy, with the same results. */
static void test_ref_fallback_no_fds(void **state)
{
    (void)state;
    tsh_server s2;
    const char *args[] = {"--no-fds", NULL};
    assert_int_equal(tsh_server_start(&s2, args), 0);
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s2.unix_addr, NULL), 0);
    int maps0 = count_server_maps();
    put_item(c, "nofds", BIG_N, 1, 0);
    for (int i = 0; i < TS_REF_MAX_ITEMS + 1; i++)
        put_item(c, "nofds", SMALL_N, 2, 1);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(c, "nofds", 0, &items), 0);
    assert_int_equal(ts_items_count(items), TS_REF_MAX_ITEMS + 2); /* ts_peek's: all */
    assert_int_equal(count_server_maps(), maps0);
    check_item(ts_items_at(items, 0), BIG_N, 1);
    ts_items_free(items);
    ts_shared_t *sh = new_shared(8, 3);
    assert_int_equal(ts_shared_put(c, "nofds", sh, NULL), 0);
    assert_null(ts_shared_value(sh));
    ts_shared_free(sh);
    assert_int_equal(ts_get_ref(c, "nofds", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    check_shared(ts_items_at(items, 0), 8, 3);
    ts_items_free(items);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s2), 0);
    tsh_server_cleanup(&s2);
}

/* Shared-buffer put and append, read back by copy and by reference. */
static void test_shared_put_append(void **state)
{
    (void)state;
    ts_shared_t *sh = new_shared(1024, 1); /* 4 MiB */
    uint64_t v1 = 0, v2 = 0;
    assert_int_equal(ts_shared_put(cl, "shput", sh, &v1), 0);
    assert_true(v1 > 0);
    assert_null(ts_shared_value(sh));
    /* Committed once: a second commit is refused, and the store did not change. */
    assert_int_equal(ts_shared_put(cl, "shput", sh, NULL), TS_EINVAL);
    assert_int_equal(ts_shared_append(cl, "shput", sh, NULL), TS_EINVAL);
    ts_shared_free(sh);
    sh = new_shared(2, 2);
    assert_int_equal(ts_shared_append(cl, "shput", sh, &v2), 0);
    assert_true(v2 > v1);
    ts_shared_free(sh);

    ts_items_t *items;
    assert_int_equal(ts_peek(cl, "shput", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    check_shared(ts_items_at(items, 0), 1024, 1);
    check_shared(ts_items_at(items, 1), 2, 2);
    ts_items_free(items);
    assert_int_equal(ts_get_ref(cl, "shput", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    check_shared(ts_items_at(items, 0), 1024, 1);
    check_shared(ts_items_at(items, 1), 2, 2);
    ts_items_free(items);

    /* Free without commit, and arguments. */
    ts_shared_free(new_shared(4, 3));
    ts_shared_free(NULL);
    assert_int_equal(ts_shared_new(NULL, &sh), TS_EINVAL);
    assert_null(ts_shared_value(NULL));
    assert_null(ts_tensor_spec_new(TS_DTYPE_INVALID, 1, (int64_t[]){4}));
    assert_null(ts_tensor_spec_new(TS_FLOAT32, TS_MAX_NDIM + 1, (int64_t[TS_MAX_NDIM + 1]){0}));
    assert_null(ts_tensor_spec_new(TS_FLOAT32, 1, (int64_t[]){-1}));
}

/* A "Name:   N kB" line of /proc/self/status or /proc/meminfo, in KiB; -1 when absent. */
static long long proc_kib(const char *file, const char *name)
{
    FILE *f = fopen(file, "r");
    if (f == NULL)
        return -1;
    char line[256];
    long long kib = -1;
    size_t n = strlen(name);
    while (kib < 0 && fgets(line, sizeof(line), f) != NULL)
        if (strncmp(line, name, n) == 0 && line[n] == ':')
            kib = strtoll(line + n + 1, NULL, 10);
    fclose(f);
    return kib;
}

/*
 * A shared buffer larger than the memory (twice what is available, at least 64 GiB) takes none
 * at its creation: its pages come as they are written, and writing a few takes a few pages.
 * (Prefaulting it would run the machine out of memory.)
 */
static void test_shared_larger_than_memory(void **state)
{
    (void)state;
    long long avail = proc_kib("/proc/meminfo", "MemAvailable");
    assert_true(avail > 0);
    int64_t n = (int64_t)avail * 1024 * 2 / 4; /* float32 */
    if (n < ((int64_t)16 << 30))
        n = (int64_t)16 << 30; /* 64 GiB */
    long long rss0 = proc_kib("/proc/self/status", "VmRSS");
    assert_true(rss0 > 0);
    ts_value_t *layout = ts_map_new();
    assert_int_equal(ts_map_set(layout, "x", ts_tensor_spec_new(TS_FLOAT32, 1, &n)), 0);
    ts_shared_t *sh = NULL;
    assert_int_equal(ts_shared_new(layout, &sh), 0);
    ts_value_free(layout);
    assert_true(ts_shared_size(sh) > (size_t)n * 4);
    const ts_tensor_t *t = ts_map_get_tensor(ts_shared_value(sh), "x");
    assert_non_null(t);
    assert_int_equal(t->shape[0], n);
    float *x = t->data;
    x[0] = 1.0f;
    x[n / 2] = 2.0f;
    x[n - 1] = 3.0f;
    assert_true(x[1] == 0.0f && x[n / 2] == 2.0f && x[n - 1] == 3.0f);
    long long rss1 = proc_kib("/proc/self/status", "VmRSS");
    long long shmem = proc_kib("/proc/self/status", "RssShmem");
    assert_true(rss1 - rss0 < 16 * 1024);
    assert_true(shmem >= 0 && shmem < 16 * 1024);
    ts_shared_free(sh);
}

/*
 * The lane is a second connection: a commit after an asynchronous put of the same thread is
 * ordered by a blocking call in between (docs/THREADING.md "Ordering guarantees").
 */
static void test_shared_put_after_async_put(void **state)
{
    (void)state;
    for (int i = 1; i <= 20; i++) {
        ts_value_t *a = ts_map_new();
        assert_int_equal(ts_map_set(a, "step", ts_int_new(-i)), 0);
        assert_int_equal(ts_put_async(cl, "shorder", a, 0, NULL, NULL), 0);
        ts_value_free(a);
        assert_int_equal(ts_ping(cl), 0);
        ts_shared_t *sh = new_shared(1, i);
        assert_int_equal(ts_shared_put(cl, "shorder", sh, NULL), 0);
        ts_shared_free(sh);
        ts_items_t *items;
        assert_int_equal(ts_peek(cl, "shorder", 0, &items), 0);
        assert_int_equal(ts_items_count(items), 1);
        check_shared(ts_items_at(items, 0), 1, i);
        ts_items_free(items);
    }
}

#define SEGV_EXIT 77 /* the exit status of a child whose write faulted */
static void segv_exit(int sig)
{
    (void)sig;
    _exit(SEGV_EXIT);
}

/* After a commit, a write through a pointer taken before faults; the stored item is intact. */
static void test_shared_write_after_commit(void **state)
{
    (void)state;
    ts_shared_t *sh = new_shared(256, 9);
    float *x = ts_map_get_tensor(ts_shared_value(sh), "x")->data;
    assert_int_equal(ts_shared_put(cl, "shwac", sh, NULL), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* Our own handler, so that a sanitizer's does not turn the fault into a report. */
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = segv_exit;
        sigaction(SIGSEGV, &sa, NULL);
        *(volatile float *)x = 12345.0f; /* must fault */
        _exit(0);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), SEGV_EXIT);
    ts_shared_free(sh);
    ts_items_t *items;
    assert_int_equal(ts_get(cl, "shwac", 0, &items), 0);
    check_shared(ts_items_at(items, 0), 256, 9);
    ts_items_free(items);
}

/*
 * A child that still maps the buffer writable (a fork before the commit) makes the server
 * refuse the seal: INVALID, and the buffer is writable again and can be committed later.
 */
static void test_shared_mapped_elsewhere(void **state)
{
    (void)state;
    ts_shared_t *sh = new_shared(8, 4);
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) { /* holds the writable mapping until the parent closes the pipe */
        close(pipefd[1]);
        char b;
        ssize_t n = read(pipefd[0], &b, 1);
        _exit(n == 0 ? 0 : 1);
    }
    close(pipefd[0]);
    assert_int_equal(ts_shared_put(cl, "shbusy", sh, NULL), TS_EINVAL);
    assert_non_null(strstr(ts_last_error(), "mapped writable"));
    close(pipefd[1]);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    /* Writable again: change it, then commit. */
    float *x = ts_map_get_tensor(ts_shared_value(sh), "x")->data;
    assert_non_null(x);
    x[0] = 0.0f + 4.0f;
    assert_int_equal(ts_shared_put(cl, "shbusy", sh, NULL), 0);
    ts_shared_free(sh);
    ts_items_t *items;
    assert_int_equal(ts_get(cl, "shbusy", 0, &items), 0);
    check_shared(ts_items_at(items, 0), 8, 4);
    ts_items_free(items);
}

/* The lane reconnects after the server restarts (same socket path). */
static void test_lane_reconnect(void **state)
{
    (void)state;
    put_item(cl, "restart", BIG_N, 8, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(cl, "restart", 0, &items), 0);
    tsh_server_kill(&srv);
    assert_int_equal(tsh_server_restart(&srv, NULL), 0);
    check_item(ts_items_at(items, 0), BIG_N, 8); /* the old server's pages, still mapped */
    ts_items_free(items);
    put_item(cl, "restart", BIG_N, 9, 0); /* the main connection reconnects */
    assert_int_equal(ts_peek_ref(cl, "restart", 0, &items), 0);
    check_item(ts_items_at(items, 0), BIG_N, 9);
    ts_items_free(items);
    ts_shared_t *sh = new_shared(4, 5);
    assert_int_equal(ts_shared_append(cl, "restart", sh, NULL), 0);
    ts_shared_free(sh);
    assert_int_equal(ts_delete(cl, "restart", NULL), 0);
}

/* A server that does not answer: the lane's calls end at the request timeout, then recover. */
static void test_lane_timeout(void **state)
{
    (void)state;
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 300;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.unix_addr, &o), 0);
    put_item(c, "slow", SMALL_N, 1, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(c, "slow", 0, &items), 0); /* the lane is open */
    ts_items_free(items);
    assert_int_equal(kill(srv.pid, SIGSTOP), 0);
    uint64_t t0 = tc_now_ms();
    assert_int_equal(ts_peek_ref(c, "slow", 0, &items), TS_ETIMEDOUT);
    uint64_t waited = tc_now_ms() - t0;
    ts_shared_t *sh = new_shared(2, 6);
    assert_int_equal(ts_shared_put(c, "slow", sh, NULL), TS_ETIMEDOUT);
    assert_int_equal(kill(srv.pid, SIGCONT), 0);
    assert_true(waited >= 250);
    assert_true(waited < TC_WAIT_MS);
    /* The timed-out lane was dropped; the next calls use a new one. */
    int rc = TS_ETIMEDOUT;
    for (int i = 0; i < 50 && rc != 0; i++) { /* bounded: the stopped server catches up */
        rc = ts_peek_ref(c, "slow", 0, &items);
        if (rc != 0)
            tc_sleep_ms(50);
    }
    assert_int_equal(rc, 0);
    ts_items_free(items);
    /* The buffer that timed out is writable again or sealed; either way it can be committed. */
    rc = ts_shared_put(c, "slow2", sh, NULL);
    assert_true(rc == 0 || rc == TS_EINVAL);
    ts_shared_free(sh);
    ts_delete(c, "slow", NULL);
    ts_delete(c, "slow2", NULL);
    ts_client_free(c);
}

/* Everything a client does by reference leaves no descriptor behind once it is freed. */
static void test_no_fd_leak(void **state)
{
    (void)state;
    int fds0 = count_fds();
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.unix_addr, NULL), 0);
    for (int i = 0; i < 5; i++) {
        put_item(c, "leak", BIG_N, i, 1);
        put_item(c, "leak", SMALL_N, i, 1);
    }
    ts_items_t *items;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ts_peek_ref(c, "leak", 0, &items), 0);
        assert_int_equal(ts_items_count(items), 10);
        ts_items_free(items);
    }
    assert_int_equal(ts_peek_ref(c, "noleak", 0, &items), TS_ENOENT);
    ts_shared_t *sh = new_shared(4, 1);
    assert_int_equal(ts_shared_append(c, "leak", sh, NULL), 0);
    ts_shared_free(sh);
    ts_shared_free(new_shared(4, 1));
    assert_int_equal(ts_get_ref(c, "leak", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 11);
    ts_items_free(items);
    ts_client_free(c);
    assert_int_equal(count_fds(), fds0);
    assert_int_equal(count_server_maps(), 0);
}

/*
 * The child of test_child_killed_with_mappings (this program run again, so that no thread of
 * the parent is inherited): map the bin's items, say so on stdout, then wait to be killed.
 */
static int child_main(const char *addr, const char *bin)
{
    ts_client_t *c;
    ts_items_t *items;
    char ok = '0';
    if (ts_client_open(&c, addr, NULL) == 0 && ts_peek_ref(c, bin, 0, &items) == 0 &&
        ts_items_count(items) == 1)
        ok = '1';
    ssize_t n = write(1, &ok, 1);
    (void)n;
    for (int i = 0; i < 600; i++) /* bounded: the parent kills it long before */
        tc_sleep_ms(100);
    return 1;
}

/* A child killed while it maps items: the server and the items are unaffected. */
static void test_child_killed_with_mappings(void **state)
{
    (void)state;
    put_item(cl, "child", BIG_N, 3, 0);
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        dup2(pipefd[1], 1);
        close(pipefd[0]);
        close(pipefd[1]);
        execl("/proc/self/exe", "test_client_shm", "--child", srv.unix_addr, "child", (char *)NULL);
        _exit(127);
    }
    close(pipefd[1]);
    char ok = 0;
    assert_int_equal(read(pipefd[0], &ok, 1), 1);
    close(pipefd[0]);
    assert_int_equal(ok, '1');
    kill(pid, SIGKILL);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(tsh_server_alive(&srv));
    ts_items_t *items;
    assert_int_equal(ts_get_ref(cl, "child", 0, &items), 0);
    check_item(ts_items_at(items, 0), BIG_N, 3);
    ts_items_free(items);
}

/* A tensor bin's item is mapped shared: rows written in place show through the mapping. */
static void test_ref_live_tensor_bin(void **state)
{
    (void)state;
    int64_t shape[2] = {1024, 256}; /* 1 MiB of float32 */
    if (ts_tensor_bin_create(cl, "live", TS_FLOAT32, 2, shape, NULL) != 0)
        fail_msg("ts_tensor_bin_create: %s", ts_last_error());
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(cl, "live", 0, &items), 0);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(t);
    assert_int_equal(t->shape[0], 1024);
    const volatile float *p = t->data;
    assert_true(p[5 * 256] == 0.0f);
    int64_t rshape[2] = {2, 256};
    ts_value_t *rows = ts_tensor_alloc(TS_FLOAT32, 2, rshape);
    float *r = ts_value_tensor(rows)->data;
    for (int i = 0; i < 512; i++)
        r[i] = (float)(i + 1);
    assert_int_equal(ts_rows_write(cl, "live", 5, rows, NULL), 0);
    ts_value_free(rows);
    /* The reply to the write came after the server wrote the rows: visible now. */
    assert_true(p[5 * 256] == 1.0f);
    assert_true(p[6 * 256 + 255] == 512.0f);
    assert_true(p[7 * 256] == 0.0f);
    ts_items_free(items);
    assert_int_equal(ts_delete(cl, "live", NULL), 0);
}

/* The lane presents the client's token like the main connection. */
static void test_lane_auth_token(void **state)
{
    (void)state;
    tsh_server s2;
    char tok_path[320];
    assert_int_equal(tsh_server_start(&s2, NULL), 0); /* for its private directory */
    snprintf(tok_path, sizeof(tok_path), "%s/token", s2.dir);
    FILE *f = fopen(tok_path, "w");
    assert_non_null(f);
    fputs("sekrit-lane\n", f);
    fclose(f);
    tsh_server_kill(&s2);
    const char *args[] = {"--auth-token-file", tok_path, NULL};
    assert_int_equal(tsh_server_restart(&s2, args), 0);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.auth_token = "sekrit-lane";
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s2.unix_addr, &o), 0);
    put_item(c, "auth", BIG_N, 2, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(c, "auth", 0, &items), 0);
    check_item(ts_items_at(items, 0), BIG_N, 2);
    ts_items_free(items);
    ts_shared_t *sh = new_shared(4, 3);
    assert_int_equal(ts_shared_put(c, "auth2", sh, NULL), 0);
    ts_shared_free(sh);
    ts_client_free(c);
    tsh_server_stop(&s2);
    tsh_server_cleanup(&s2);
}

/* Several threads share one client's lane: every call gets its own, whole answer. */
#define LANE_THREADS 4
#define LANE_ROUNDS  10
static void *lane_worker(void *arg)
{
    long bad = 0;
    for (int i = 0; i < LANE_ROUNDS; i++) {
        ts_items_t *items;
        if (ts_peek_ref(cl, "shared-lane", 0, &items) != 0) {
            bad++;
            continue;
        }
        const ts_tensor_t *t = ts_map_get_tensor(ts_items_at(items, 0), "x");
        if (t == NULL || t->shape[0] != BIG_N ||
            ((const float *)t->data)[BIG_N - 1] != (float)(BIG_N - 1) * 0.5f + 4.0f)
            bad++;
        ts_items_free(items);
        ts_shared_t *sh;
        ts_value_t *layout = ts_map_new();
        int64_t n = 16;
        ts_map_set(layout, "x", ts_tensor_spec_new(TS_INT8, 1, &n));
        if (ts_shared_new(layout, &sh) != 0 || ts_shared_append(cl, "lane-out", sh, NULL) != 0)
            bad++;
        ts_value_free(layout);
        ts_shared_free(sh);
    }
    *(long *)arg = bad;
    return NULL;
}

static void test_lane_threads(void **state)
{
    (void)state;
    put_item(cl, "shared-lane", BIG_N, 4, 0);
    pthread_t th[LANE_THREADS];
    long bad[LANE_THREADS];
    for (int i = 0; i < LANE_THREADS; i++)
        assert_int_equal(pthread_create(&th[i], NULL, lane_worker, &bad[i]), 0);
    for (int i = 0; i < LANE_THREADS; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(bad[i], 0);
    }
    uint32_t n;
    assert_int_equal(ts_delete(cl, "lane-out", &n), 0);
    assert_int_equal(n, LANE_THREADS * LANE_ROUNDS);
    assert_int_equal(ts_delete(cl, "shared-lane", NULL), 0);
}

/* ts_client_free ends a by-reference call blocked on the lane (TS_ECANCELED), at once. */
typedef struct blocked_call {
    ts_client_t *c;
    int rc;
    tc_latch started;
} blocked_call;

static void *blocked_peek(void *arg)
{
    blocked_call *b = arg;
    ts_items_t *items;
    tc_latch_add(&b->started, 1);
    b->rc = ts_peek_ref(b->c, "blocked", 0, &items);
    if (b->rc == 0)
        ts_items_free(items);
    return NULL;
}

static void test_free_cancels_lane_call(void **state)
{
    (void)state;
    blocked_call b = {.rc = 1};
    tc_latch_init(&b.started);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 15000;
    assert_int_equal(ts_client_open(&b.c, srv.unix_addr, &o), 0);
    put_item(b.c, "blocked", SMALL_N, 1, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(b.c, "blocked", 0, &items), 0); /* the lane is open */
    ts_items_free(items);
    assert_int_equal(kill(srv.pid, SIGSTOP), 0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, blocked_peek, &b), 0);
    assert_int_equal(tc_latch_wait(&b.started, 1, TC_WAIT_MS), 1);
    tc_sleep_ms(100); /* let it reach its poll (it returns TS_ECANCELED either way) */
    uint64_t t0 = tc_now_ms();
    ts_client_free(b.c);
    pthread_join(th, NULL);
    uint64_t took = tc_now_ms() - t0;
    assert_int_equal(kill(srv.pid, SIGCONT), 0);
    assert_int_equal(b.rc, TS_ECANCELED);
    assert_true(took < 10000); /* well before the 15 s request timeout */
    tc_latch_destroy(&b.started);
    ts_delete(cl, "blocked", NULL);
}

/*
 * Every allocation of a by-reference peek and of a shared put failing in turn: each call fails
 * cleanly (or succeeds), and no descriptor or mapping is left behind (ASan checks the memory).
 */
static void test_ref_alloc_failures(void **state)
{
    (void)state;
    put_item(cl, "allocs", BIG_N, 1, 0);
    put_item(cl, "allocs", SMALL_N, 2, 1);
    int fds0 = count_fds();
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, srv.unix_addr, NULL), 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(c, "allocs", 0, &items), 0); /* the lane is open */
    ts_items_free(items);
    int maps0 = count_server_maps();
    int ok = 0;
    for (long n = 1; n <= 30; n++) {
        ts__alloc_fail_after(n);
        int rc = ts_peek_ref(c, "allocs", 0, &items);
        ts__alloc_fail_after(-1);
        if (rc == 0) {
            check_item(ts_items_at(items, 0), BIG_N, 1);
            ts_items_free(items);
            ok++;
        }
        int64_t dim = 64;
        ts_value_t *layout = ts_map_new();
        assert_int_equal(ts_map_set(layout, "x", ts_tensor_spec_new(TS_FLOAT32, 1, &dim)), 0);
        ts_shared_t *sh = NULL;
        ts__alloc_fail_after(n);
        rc = ts_shared_new(layout, &sh);
        if (rc == 0)
            rc = ts_shared_append(c, "allocs-out", sh, NULL);
        ts__alloc_fail_after(-1);
        ts_shared_free(sh);
        ts_value_free(layout);
        assert_int_equal(count_server_maps(), maps0);
    }
    assert_true(ok > 0); /* past the call's allocations, the call works */
    ts_client_free(c);
    assert_int_equal(count_fds(), fds0);
    ts_delete(cl, "allocs", NULL);
    ts_delete(cl, "allocs-out", NULL);
}

/* A server full (--max-clients 1) refuses the lane: the calls copy through the main connection. */
static void test_ref_fallback_too_many(void **state)
{
    (void)state;
    tsh_server s2;
    const char *args[] = {"--max-clients", "1", NULL};
    assert_int_equal(tsh_server_start(&s2, args), 0);
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s2.unix_addr, NULL), 0);
    put_item(c, "full", BIG_N, 5, 0);
    ts_items_t *items;
    assert_int_equal(ts_peek_ref(c, "full", 0, &items), 0);
    check_item(ts_items_at(items, 0), BIG_N, 5);
    ts_items_free(items);
    ts_shared_t *sh = new_shared(2, 6);
    assert_int_equal(ts_shared_append(c, "full", sh, NULL), 0);
    ts_shared_free(sh);
    assert_int_equal(ts_get_ref(c, "full", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 2);
    check_shared(ts_items_at(items, 1), 2, 6);
    ts_items_free(items);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s2), 0);
    tsh_server_cleanup(&s2);
}

/* ts_client_free also ends a by-reference call that waits to reconnect its lane. */
static void test_free_cancels_lane_reconnect(void **state)
{
    (void)state;
    tsh_server s2;
    assert_int_equal(tsh_server_start(&s2, NULL), 0);
    blocked_call b = {.rc = 1};
    tc_latch_init(&b.started);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 15000;
    o.reconnect_max_ms = 5000;
    assert_int_equal(ts_client_open(&b.c, s2.unix_addr, &o), 0);
    tsh_server_kill(&s2); /* nobody listens: the lane retries its connection */
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, blocked_peek, &b), 0);
    assert_int_equal(tc_latch_wait(&b.started, 1, TC_WAIT_MS), 1);
    tc_sleep_ms(300);
    uint64_t t0 = tc_now_ms();
    ts_client_free(b.c);
    pthread_join(th, NULL);
    assert_int_equal(b.rc, TS_ECANCELED);
    assert_true(tc_now_ms() - t0 < 10000);
    tc_latch_destroy(&b.started);
    tsh_server_cleanup(&s2);
}

/* Calls from a client callback are refused like every blocking call. */
static tc_latch cb_latch;
static int cb_rc;
static void deadlk_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)status;
    (void)res;
    (void)arg;
    ts_items_t *items;
    cb_rc = ts_peek_ref(c, "x", 0, &items);
    tc_latch_add(&cb_latch, 1);
}

static void test_ref_from_callback(void **state)
{
    (void)state;
    tc_latch_init(&cb_latch);
    assert_int_equal(ts_ping_async(cl, deadlk_cb, NULL), 0);
    assert_int_equal(tc_latch_wait(&cb_latch, 1, TC_WAIT_MS), 1);
    assert_int_equal(cb_rc, TS_EDEADLK);
    tc_latch_destroy(&cb_latch);
}

/* ---------------------------------------------------------------------------------------------
 * A scripted server on a unix socket, to send the client REF_ITEMS replies tensord never sends:
 * valid ones with extra descriptors, and malformed ones. The first connection is the client's
 * main one (HELLO answered, then ignored), the second its descriptor lane (HELLO with FDS, then
 * every request answered by the script).
 */
enum {
    FAKE_OK = 0,      /* an fd entry and an inline entry, plus two descriptors nobody claims */
    FAKE_SHORT_FILE,  /* the fd entry reaches past the end of its file */
    FAKE_BAD_RECORD,  /* the file holds no valid record */
    FAKE_MISSING_FD,  /* n_fds 1, no descriptor attached */
    FAKE_BAD_HEADER,  /* a reply header with a wrong magic, descriptors attached */
    FAKE_TOO_MANY_FDS /* more descriptors than a reply may carry */
};

typedef struct fake_srv {
    char dir[64];
    char path[128];
    char addr[140];
    int lfd;
    int mode;
    pthread_t th;
} fake_srv;

/* A memfd named "fake" with the record of make_item(n, seed) at offset 4096; *len its length. */
static int fake_memfd(int64_t n, int seed, size_t *len, int corrupt)
{
    ts_value_t *v = make_item(n, seed);
    uint8_t *rec;
    size_t rlen;
    assert_int_equal(ts__record_encode(v, &rec, &rlen), 0);
    ts_value_free(v);
    if (corrupt)
        rec[0] = 'X';
    int fd = memfd_create("fake", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(ftruncate(fd, (off_t)(4096 + rlen)), 0);
    assert_int_equal(pwrite(fd, rec, rlen, 4096), (ssize_t)rlen);
    ts__free_aligned(rec, rlen);
    *len = rlen;
    return fd;
}

/* Send a frame with descriptors attached to its first byte. */
static void fake_send(int fd, const uint8_t *frame, size_t len, const int *fds, size_t nfds)
{
    struct iovec iov = {.iov_base = (void *)frame, .iov_len = len};
    union {
        struct cmsghdr h;
        char space[CMSG_SPACE(sizeof(int) * 80)];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (nfds > 0) {
        mh.msg_control = ctl.space;
        mh.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
    }
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL);
    if (n > 0 && (size_t)n < len)
        tsh_write_all(fd, frame + n, len - (size_t)n);
}

static void fake_reply(int fd, uint8_t op, uint32_t id, uint16_t status, const uint8_t *body,
                       size_t len, const int *fds, size_t nfds)
{
    uint8_t *frame = malloc(TS_HDR_SIZE + len);
    ts__hdr h = {.magic = TS_MAGIC_REP,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .status = status,
                 .request_id = id,
                 .body_len = len};
    ts__hdr_encode(&h, frame);
    if (len > 0)
        memcpy(frame + TS_HDR_SIZE, body, len);
    fake_send(fd, frame, TS_HDR_SIZE + len, fds, nfds);
    free(frame);
}

/* Read one request (header and body); 0, or -1 at the end of the connection. */
static int fake_read(int fd, ts__hdr *h, uint8_t *body, size_t cap)
{
    uint8_t hdr[TS_HDR_SIZE];
    if (tsh_read_all(fd, hdr, sizeof(hdr)) != 0 || ts__hdr_decode(hdr, TS_MAGIC_REQ, h) != 0 ||
        h->body_len > cap)
        return -1;
    return h->body_len == 0 ? 0 : tsh_read_all(fd, body, (size_t)h->body_len);
}

static void fake_hello(int fd, uint8_t flags)
{
    ts__hdr h;
    uint8_t body[4096];
    if (fake_read(fd, &h, body, sizeof(body)) != 0)
        return;
    uint8_t rep[TS_MSG_HELLO_REP_SIZE];
    size_t len;
    ts__msg_hello_rep m = {.version = TS_PROTO_VERSION, .flags = flags, .max_body = 1 << 30};
    assert_int_equal(ts__msg_hello_rep_encode(rep, sizeof(rep), &m, &len), 0);
    fake_reply(fd, TS_OP_HELLO, h.request_id, 0, rep, len, NULL, 0);
}

/* Answer the lane's requests by the script until the client goes. */
static void fake_lane(fake_srv *f, int fd)
{
    fake_hello(fd, TS_HELLO_FDS);
    ts__hdr h;
    uint8_t body[4096];
    while (fake_read(fd, &h, body, sizeof(body)) == 0) {
        size_t flen, ilen;
        int mfd = fake_memfd(BIG_N / 16, 11, &flen, f->mode == FAKE_BAD_RECORD);
        /* The inline record, encoded at its place after the head. */
        ts_value_t *iv = make_item(SMALL_N, 12);
        uint8_t *irec;
        assert_int_equal(ts__record_encode(iv, &irec, &ilen), 0);
        ts_value_free(iv);
        ts__msg_ref_entry e[2];
        memset(e, 0, sizeof(e));
        e[0].where = TS_REF_FD;
        e[0].offset = 4096;
        e[0].length = flen;
        e[0].file_len = 4096 + flen;
        if (f->mode == FAKE_SHORT_FILE) {
            e[0].length = flen + 8192; /* the header says more than the file holds */
            e[0].file_len = 4096 + flen + 8192;
        }
        e[1].where = TS_REF_INLINE;
        e[1].length = ilen;
        const uint8_t *recs[2] = {NULL, irec};
        uint64_t size;
        assert_int_equal(ts__msg_ref_size(2, e, &size), 0);
        uint8_t *rb = calloc(1, (size_t)size);
        size_t rlen;
        assert_int_equal(ts__msg_ref_encode(rb, (size_t)size, 5, 0, 2, e, recs, &rlen), 0);
        int fds[80];
        size_t nfds = 0;
        fds[nfds++] = mfd;
        if (f->mode == FAKE_OK) {
            fds[nfds++] = fake_memfd(4, 1, &flen, 0);
            fds[nfds++] = fake_memfd(4, 2, &flen, 0);
        } else if (f->mode == FAKE_MISSING_FD) {
            nfds = 0;
        } else if (f->mode == FAKE_TOO_MANY_FDS) {
            while (nfds < 80)
                fds[nfds++] = dup(mfd);
        }
        if (f->mode == FAKE_BAD_HEADER) {
            uint8_t frame[TS_HDR_SIZE] = {0x99};
            fake_send(fd, frame, sizeof(frame), fds, nfds);
        } else {
            fake_reply(fd, h.opcode, h.request_id, 0, rb, rlen, fds, nfds);
        }
        for (size_t i = 0; i < nfds; i++)
            close(fds[i]);
        if (nfds == 0)
            close(mfd);
        free(rb);
        ts__free_aligned(irec, ilen);
    }
}

static void *fake_main(void *arg)
{
    fake_srv *f = arg;
    int main_fd = -1;
    for (int conns = 0; conns < 8; conns++) { /* the main connection, then lanes */
        struct pollfd p = {.fd = f->lfd, .events = POLLIN};
        if (poll(&p, 1, TC_WAIT_MS) <= 0)
            break;
        int fd = accept(f->lfd, NULL, NULL);
        if (fd < 0)
            break;
        if (main_fd < 0) {
            main_fd = fd;
            fake_hello(fd, 0);
            continue;
        }
        fake_lane(f, fd);
        close(fd);
    }
    if (main_fd >= 0)
        close(main_fd);
    return NULL;
}

static void fake_start(fake_srv *f, int mode)
{
    memset(f, 0, sizeof(*f));
    f->mode = mode;
    snprintf(f->dir, sizeof(f->dir), "/tmp/tsfake.XXXXXX");
    assert_non_null(mkdtemp(f->dir));
    snprintf(f->path, sizeof(f->path), "%s/s.sock", f->dir);
    snprintf(f->addr, sizeof(f->addr), "unix:%s", f->path);
    f->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    memcpy(sa.sun_path, f->path, strlen(f->path) + 1);
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(f->lfd, 8), 0);
    assert_int_equal(pthread_create(&f->th, NULL, fake_main, f), 0);
}

static void fake_stop(fake_srv *f)
{
    shutdown(f->lfd, SHUT_RDWR);
    pthread_join(f->th, NULL);
    close(f->lfd);
    unlink(f->path);
    rmdir(f->dir);
}

/* Mappings of the scripted server's memfds. */
static int count_fake_maps(void)
{
    FILE *fp = fopen("/proc/self/maps", "r");
    if (fp == NULL)
        return -1;
    char line[1024];
    int n = 0;
    while (fgets(line, sizeof(line), fp) != NULL)
        if (strstr(line, "/memfd:fake") != NULL)
            n++;
    fclose(fp);
    return n;
}

/*
 * Descriptors a reply does not claim are closed; malformed replies fail with TS_EPROTO, close
 * the lane and every descriptor that came with them; nothing leaks, nothing stays mapped.
 */
static void test_scripted_replies(void **state)
{
    (void)state;
    static const int modes[] = {FAKE_OK,         FAKE_SHORT_FILE, FAKE_BAD_RECORD,
                                FAKE_MISSING_FD, FAKE_BAD_HEADER, FAKE_TOO_MANY_FDS};
    for (size_t m = 0; m < sizeof(modes) / sizeof(modes[0]); m++) {
        int fds0 = count_fds();
        fake_srv f;
        fake_start(&f, modes[m]);
        ts_client_options_t o;
        ts_client_options_init(&o);
        o.request_timeout_ms = 2000;
        ts_client_t *c;
        assert_int_equal(ts_client_open(&c, f.addr, &o), 0);
        for (int round = 0; round < 2; round++) { /* the second one reopens a closed lane */
            ts_items_t *items = NULL;
            int rc = ts_peek_ref(c, "b", 0, &items);
            if (modes[m] == FAKE_OK) {
                if (rc != 0)
                    fail_msg("%s (%s)", ts_err_name(rc), ts_last_error());
                assert_int_equal(ts_items_count(items), 2);
                assert_int_equal(ts_items_version(items), 5);
                check_item(ts_items_at(items, 0), BIG_N / 16, 11);
                check_item(ts_items_at(items, 1), SMALL_N, 12);
                assert_int_equal(count_fake_maps(), 1); /* the extra descriptors: not mapped */
                ts_items_free(items);
            } else {
                if (rc != TS_EPROTO)
                    fail_msg("mode %d round %d: %s (%s)", modes[m], round, ts_err_name(rc),
                             ts_last_error());
                assert_null(items);
            }
            assert_int_equal(count_fake_maps(), 0);
        }
        ts_client_free(c);
        fake_stop(&f);
        if (count_fds() != fds0)
            fail_msg("mode %d: %d descriptors before, %d after", modes[m], fds0, count_fds());
    }
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child") == 0)
        return child_main(argv[2], argv[3]);
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ref_large_and_small),
        cmocka_unit_test(test_ref_max_items),
        cmocka_unit_test(test_ref_fallback_tcp),
        cmocka_unit_test(test_ref_fallback_no_fds),
        cmocka_unit_test(test_ref_mapping_outlives_item),
        cmocka_unit_test(test_shared_put_append),
        cmocka_unit_test(test_shared_larger_than_memory),
        cmocka_unit_test(test_shared_put_after_async_put),
        cmocka_unit_test(test_shared_write_after_commit),
        cmocka_unit_test(test_shared_mapped_elsewhere),
        cmocka_unit_test(test_ref_from_callback),
        cmocka_unit_test(test_ref_live_tensor_bin),
        cmocka_unit_test(test_lane_threads),
        cmocka_unit_test(test_ref_alloc_failures),
        cmocka_unit_test(test_free_cancels_lane_call),
        cmocka_unit_test(test_free_cancels_lane_reconnect),
        cmocka_unit_test(test_ref_fallback_too_many),
        cmocka_unit_test(test_lane_auth_token),
        cmocka_unit_test(test_child_killed_with_mappings),
        cmocka_unit_test(test_no_fd_leak),
        cmocka_unit_test(test_lane_timeout),
        cmocka_unit_test(test_lane_reconnect),
        cmocka_unit_test(test_scripted_replies),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
