/*
 * tensord persistence: a clean shutdown keeps every bin, item, version and the change counter;
 * SAVE answers once the snapshot is durable; SIGKILL under load loses at most what came after
 * the last snapshot (never anything acknowledged before a SAVE returned), and clients
 * reconnect and carry on; a damaged, truncated or foreign snapshot is refused (exit status 3,
 * naming the file and the problem) and never half-loaded or overwritten.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tensorshare/tensorshare.h"
#include "test_harden_util.h"

static tsh_server s;
static char snap[400], errfile[400], copy[400];

static int kill_leftover(void **state)
{
    (void)state;
    if (s.pid > 0)
        tsh_server_kill(&s);
    if (s.dir[0] != '\0') {
        char p[450];
        snprintf(p, sizeof(p), "%s.tmp", snap);
        unlink(p);
        unlink(snap);
        unlink(errfile);
        unlink(copy);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    return 0;
}

/* Start tensord with --save in its own directory (plus extra arguments). */
static void start_saving(const char *const *extra)
{
    const char *args[16] = {"--save", NULL};
    int n = 1;
    /* The path is only known once the harness has made the directory: start, then restart. */
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    snprintf(snap, sizeof(snap), "%s/snap", s.dir);
    snprintf(errfile, sizeof(errfile), "%s/stderr", s.dir);
    snprintf(copy, sizeof(copy), "%s/copy", s.dir);
    args[n++] = snap;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 15; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(tsh_server_restart(&s, args), 0);
}

static void restart_saving(const char *const *extra)
{
    const char *args[16] = {"--save", snap};
    int n = 2;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 15; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    assert_int_equal(tsh_server_restart(&s, args), 0);
}

static void save(int fd, uint32_t rid)
{
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, rid, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, rid, TS_ST_OK);
    tsu_frame_free(&f);
}

#define NSMALL 200

static void test_clean_shutdown_keeps_everything(void **state)
{
    (void)state;
    start_saving(NULL);
    int fd = tsu_client(&s);
    uint64_t ver[NSMALL];
    for (int i = 0; i < NSMALL; i++) {
        char name[32];
        snprintf(name, sizeof(name), "small/%03d", i);
        ver[i] = tsu_put_int(fd, TS_OP_PUT, name, i * 7, NULL);
    }
    /* A bin of several items, and a large one. */
    uint64_t vq = 0;
    for (int i = 0; i < 5; i++)
        vq = tsu_put_int(fd, TS_OP_APPEND, "queue", 100 + i, NULL);
    size_t blen;
    uint8_t *big = tsu_rec_bytes((size_t)3 << 20, 77, &blen);
    uint64_t vb = tsu_store(fd, TS_OP_PUT, "big", big, blen, NULL);
    int64_t counter = tsu_stat(fd, "version");
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    restart_saving(NULL);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), NSMALL + 2);
    assert_true(tsu_stat(fd, "version") >= counter);
    for (int i = 0; i < NSMALL; i++) {
        char name[32];
        snprintf(name, sizeof(name), "small/%03d", i);
        tsu_items it;
        tsu_get(fd, TS_OP_PEEK, name, 0, &it);
        assert_int_equal(it.n, 1);
        assert_int_equal(it.version, ver[i]);
        assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), i * 7);
        tsu_frame_free(&it.f);
    }
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "queue", 0, &it);
    assert_int_equal(it.n, 5);
    assert_int_equal(it.version, vq);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(tsu_item_int(it.item[i], it.item_len[i]), 100 + (int)i);
    tsu_frame_free(&it.f);
    tsu_get(fd, TS_OP_PEEK, "big", 0, &it);
    assert_int_equal(it.version, vb);
    assert_int_equal(it.item_len[0], blen);
    assert_memory_equal(it.item[0], big, blen);
    tsu_frame_free(&it.f);
    tsu_rec_free(big, blen);
    /* The change counter goes on from where it was: a new change is newer than every old one. */
    uint64_t vn = tsu_put_int(fd, TS_OP_PUT, "after", 1, NULL);
    assert_true(vn > vb && (int64_t)vn > counter);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

static void test_save_request(void **state)
{
    (void)state;
    start_saving((const char *const[]){"--save-interval", "0", NULL});
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    save(fd, 1);
    struct stat st;
    assert_int_equal(stat(snap, &st), 0);
    assert_true((st.st_mode & 077) == 0); /* the data may be private */
    /* Nothing changed since: answered at once. Pipelined SAVEs all get their answer. */
    save(fd, 2);
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(tsh_send(fd, TS_OP_SAVE, 10 + i, NULL, 0), 0);
    for (uint32_t i = 0; i < 5; i++) {
        tsu_frame f;
        assert_int_equal(tsu_recv(fd, &f), 0);
        assert_int_equal(f.h.opcode, TS_OP_SAVE);
        assert_int_equal(f.h.status, TS_ST_OK);
        tsu_frame_free(&f);
    }
    assert_true(tsu_stat(fd, "snapshots") >= 2);
    /* tsctl save, and the library's ts_save. */
    const char *build = getenv("TS_BUILD_DIR");
    char cmd[1200];
    tsu_put_int(fd, TS_OP_PUT, "c", 3, NULL);
    snprintf(cmd, sizeof(cmd), "'%s/bin/tsctl' --port %d save >/dev/null", build, s.port);
    assert_int_equal(system(cmd), 0);
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, NULL), 0);
    assert_int_equal(ts_save(c), 0);
    ts_client_free(c);
    close(fd);
    /* What SAVE acknowledged survives SIGKILL. */
    tsh_server_kill(&s);
    restart_saving(NULL);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), 3);
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, "c", 0, &it);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 3);
    tsu_frame_free(&it.f);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

static void test_save_failure_reported(void **state)
{
    (void)state;
    /* A directory that does not exist: tensord starts empty, SAVE says why it failed. */
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    snprintf(snap, sizeof(snap), "%s/missing-dir/snap", s.dir);
    assert_int_equal(tsh_server_restart(&s, (const char *const[]){"--save", snap, NULL}), 0);
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 5, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 5, TS_ST_INTERNAL);
    assert_non_null(memmem(f.body, f.len, "missing-dir", 11));
    tsu_frame_free(&f);
    /* The daemon carries on; only the clean shutdown reports (exit 1) that nothing is saved. */
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 1);
}

/* ---------------------------------------------------------------------------------------------
 * SIGKILL under load
 */

#define KBINS  16
#define ROUNDS 3

typedef struct killer {
    pthread_t t;
    int delay_ms;
} killer;

static void *kill_later(void *arg)
{
    killer *k = arg;
    th_sleep_ms(k->delay_ms);
    tsh_server_kill(&s);
    return NULL;
}

static void test_sigkill_under_load(void **state)
{
    (void)state;
    static const char *const extra[] = {"--save-interval", "1", NULL};
    start_saving(extra);
    ts_options_t o;
    ts_options_init(&o);
    o.request_timeout_ms = 10000;
    o.reconnect_max_ms = 200;
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, &o), 0);
    int64_t acked[KBINS] = {0};   /* last value whose put was acknowledged */
    int64_t tried[KBINS] = {0};   /* last value sent (maybe applied, maybe not) */
    int64_t durable[KBINS] = {0}; /* acknowledged before a SAVE that returned OK */
    long checked = 0, puts = 0, saves = 0;
    int64_t next = 1;
    unsigned seed = 12345;
    for (int round = 0; round < ROUNDS; round++) {
        killer k = {.delay_ms = 400 + (int)(rand_r(&seed) % 800)};
        assert_int_equal(pthread_create(&k.t, NULL, kill_later, &k), 0);
        /* Load until the daemon dies under it. */
        for (int i = 0;; i++) {
            int b = i % KBINS;
            char name[16];
            snprintf(name, sizeof(name), "k%02d", b);
            ts_value_t *v = ts_int_new(next);
            tried[b] = next;
            int rc = ts_put(c, name, v, NULL);
            ts_value_free(v);
            if (rc != 0)
                break;
            acked[b] = next++;
            puts++;
            if (i % 97 == 96) {
                int64_t snapshot_of[KBINS];
                memcpy(snapshot_of, acked, sizeof(acked));
                if (ts_save(c) != 0)
                    break;
                memcpy(durable, snapshot_of, sizeof(durable));
                saves++;
            }
        }
        pthread_join(k.t, NULL);
        next++;
        restart_saving(extra);
        /* The same client reconnects by itself; what was durable is back. */
        for (int b = 0; b < KBINS; b++) {
            char name[16];
            snprintf(name, sizeof(name), "k%02d", b);
            ts_items_t *items = NULL;
            int rc = ts_peek(c, name, 0, &items);
            if (durable[b] == 0 && rc == TS_ENOENT)
                continue;
            assert_int_equal(rc, 0);
            int64_t got = -1;
            assert_int_equal(ts_value_int(ts_items_at(items, 0), &got), 0);
            ts_items_free(items);
            if (got < durable[b] || got > tried[b])
                print_error("bin %s: %lld after restart; durable %lld, last sent %lld\n", name,
                            (long long)got, (long long)durable[b], (long long)tried[b]);
            assert_true(got >= durable[b] && got <= tried[b]);
            acked[b] = tried[b] = got;
            checked++;
        }
    }
    print_message("SIGKILL under load: %d kills survived, %ld puts and %ld SAVEs acknowledged, "
                  "%ld bins checked after restarts: nothing durable was lost\n",
                  ROUNDS, puts, saves, checked);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* ---------------------------------------------------------------------------------------------
 * Damaged snapshots
 */

static uint8_t *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = ts__malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* tensord must refuse copy (exit 3, naming it and the problem) and leave it as it was. */
static void expect_refused(const uint8_t *data, size_t len, const char *problem)
{
    assert_int_equal(th_write_file(copy, data, len), 0);
    const char *args[] = {"--port", "0", "--save", copy, NULL};
    int st = th_run_tensord(args, errfile, 20000);
    if (st != 3 || !th_file_contains(errfile, copy) || !th_file_contains(errfile, problem)) {
        print_error("%zu bytes: exit %d, want 3 and \"%s\"\n", len, st, problem);
        fail();
    }
    size_t n;
    uint8_t *after = read_file(copy, &n);
    assert_int_equal(n, len);
    assert_memory_equal(after, data, len);
    ts__free(after);
}

static void test_damaged_snapshots_refused(void **state)
{
    (void)state;
    start_saving(NULL);
    int fd = tsu_client(&s);
    for (int i = 0; i < 5; i++)
        tsu_put_int(fd, TS_OP_APPEND, "q", i, NULL);
    size_t blen;
    uint8_t *rec = tsu_rec_bytes(3000, 1, &blen);
    tsu_store(fd, TS_OP_PUT, "tensor", rec, blen, NULL);
    tsu_rec_free(rec, blen);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    size_t len;
    uint8_t *good = read_file(snap, &len);
    uint8_t *bad = ts__malloc(len + 64);
    assert_non_null(bad);
    int tried = 0;

    /* A byte flipped anywhere: header, bin headers, item data, hashes, trailer. */
    for (size_t off = 0; off < len; off += (off < 128 || off + 64 > len) ? 7 : 97) {
        memcpy(bad, good, len);
        bad[off] ^= 0x10;
        expect_refused(bad, len, off < 8 ? "not a tensord snapshot" : "damaged");
        tried++;
    }
    /* Cut short anywhere. */
    for (size_t cut = 0; cut < len; cut += (cut < 128 || cut + 64 > len) ? 5 : 211) {
        expect_refused(good, cut, cut >= 64 ? "truncated" : "");
        tried++;
    }
    /* Bytes after the end, and a file of something else entirely. */
    memcpy(bad, good, len);
    memset(bad + len, 0, 64);
    expect_refused(bad, len + 64, "unexpected bytes");
    expect_refused((const uint8_t *)"{\"not\": \"a snapshot\"}\n", 22, "");
    tried += 2;
    print_message("damaged snapshots: %d variants of a %zu-byte file, every one refused with "
                  "exit status 3 and left as it was\n",
                  tried, len);
    /* The good one still loads. */
    assert_int_equal(th_write_file(copy, good, len), 0);
    restart_saving(NULL);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "items"), 6);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    ts__free(bad);
    ts__free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_clean_shutdown_keeps_everything, kill_leftover),
        cmocka_unit_test_teardown(test_save_request, kill_leftover),
        cmocka_unit_test_teardown(test_save_failure_reported, kill_leftover),
        cmocka_unit_test_teardown(test_sigkill_under_load, kill_leftover),
        cmocka_unit_test_teardown(test_damaged_snapshots_refused, kill_leftover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
