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

#include <errno.h>
#include <fcntl.h>
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
/* Where start_in_subdir's daemon writes its log (its stderr). */
static char logfile[400];
/* The snapshot directory d (inside the test's directory), for the tests that break it. */
static char dsub[300], dgone[310];

static void subdir_cleanup(void);

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
        unlink(logfile);
        if (dsub[0] != '\0') {
            struct stat st;
            if (lstat(dsub, &st) == 0 && S_ISREG(st.st_mode)) {
                unlink(dsub);
                rename(dgone, dsub);
            }
            subdir_cleanup();
        }
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    dsub[0] = dgone[0] = logfile[0] = '\0';
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

/*
 * Records of half a mebibyte up to one: the snapshot writer gathers small pieces in a 1 MiB
 * buffer and writes pieces of half that or more straight to the file, which must come after
 * what the buffer already holds, or the file is out of order and refused at the next start.
 */
static void test_records_around_the_write_buffer(void **state)
{
    (void)state;
    static const size_t sizes[] = {(size_t)512 << 10, (size_t)600 << 10, (size_t)1000 << 10,
                                   (size_t)1 << 20};
    start_saving(NULL);
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a-small", 5, NULL);
    uint64_t ver[TS__ARRAY_SIZE(sizes)];
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        char name[32];
        snprintf(name, sizeof(name), "b-rec%zu", i);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(sizes[i], (unsigned)i + 1, &len);
        ver[i] = tsu_store(fd, TS_OP_PUT, name, rec, len, NULL);
        tsu_rec_free(rec, len);
    }
    save(fd, 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    restart_saving(NULL);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), TS__ARRAY_SIZE(sizes) + 1);
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        char name[32];
        snprintf(name, sizeof(name), "b-rec%zu", i);
        size_t len;
        uint8_t *rec = tsu_rec_bytes(sizes[i], (unsigned)i + 1, &len);
        tsu_items it;
        tsu_get(fd, TS_OP_PEEK, name, 0, &it);
        assert_int_equal(it.n, 1);
        assert_int_equal(it.version, ver[i]);
        assert_int_equal(it.item_len[0], len);
        assert_memory_equal(it.item[0], rec, len);
        tsu_frame_free(&it.f);
        tsu_rec_free(rec, len);
    }
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

static void start_in_subdir(const char *const *extra)
{
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    snprintf(dsub, sizeof(dsub), "%s/d", s.dir);
    snprintf(dgone, sizeof(dgone), "%s/d.gone", s.dir);
    snprintf(snap, sizeof(snap), "%s/snap", dsub);
    snprintf(errfile, sizeof(errfile), "%s/stderr", s.dir);
    snprintf(copy, sizeof(copy), "%s/copy", s.dir);
    snprintf(logfile, sizeof(logfile), "%s/tensord.log", s.dir);
    assert_int_equal(mkdir(dsub, 0700), 0);
    const char *args[16] = {"--save", snap, "--save-interval", "0", NULL};
    int n = 4;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 15; i++)
        args[n++] = extra[i];
    args[n] = NULL;
    /*
     * The harness lets the daemon inherit this process's stderr: point that at logfile just
     * while the daemon is forked, so that the tests can read what it logs.
     */
    fflush(stderr);
    int saved = dup(2);
    assert_true(saved >= 0);
    int lfd = open(logfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    assert_true(lfd >= 0);
    assert_int_equal(dup2(lfd, 2), 2);
    close(lfd);
    int rc = tsh_server_restart(&s, args);
    assert_int_equal(dup2(saved, 2), 2);
    close(saved);
    assert_int_equal(rc, 0);
}

/*
 * Make every snapshot fail in a way root cannot bypass: the directory moves away and a plain
 * file takes its name, so creating the temporary file gives ENOTDIR.
 */
static void break_dir(void)
{
    assert_int_equal(rename(dsub, dgone), 0);
    assert_int_equal(th_write_file(dsub, "x", 1), 0);
}

static void mend_dir(void)
{
    assert_int_equal(unlink(dsub), 0);
    assert_int_equal(rename(dgone, dsub), 0);
}

/* Remove what start_in_subdir made (the daemon stopped). */
static void subdir_cleanup(void)
{
    char p[450];
    snprintf(p, sizeof(p), "%s.lock", snap);
    unlink(p);
    snprintf(p, sizeof(p), "%s.tmp", snap);
    unlink(p);
    unlink(snap);
    rmdir(dsub);
}

static void test_save_failure_reported(void **state)
{
    (void)state;
    start_in_subdir((const char *const[]){"--stop-writes-on-save-error", "no", NULL});
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    break_dir();
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 5, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 5, TS_ST_INTERNAL);
    /* The client learns that it failed; where the server keeps its files stays in the log. */
    assert_non_null(memmem(f.body, f.len, "server log", 10));
    assert_null(memmem(f.body, f.len, s.dir, strlen(s.dir)));
    assert_null(memmem(f.body, f.len, "/d/", 3));
    tsu_frame_free(&f);
    /* The daemon carries on; only the clean shutdown reports (exit 1) that nothing is saved. */
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 1);
    /* The operator's log names the file and the reason (the directory is now a plain file). */
    if (!th_file_contains(logfile, snap) || !th_file_contains(logfile, strerror(ENOTDIR))) {
        print_error("tensord's log %s does not name %s and \"%s\"\n", logfile, snap,
                    strerror(ENOTDIR));
        fail();
    }
    mend_dir();
    subdir_cleanup();
}

/* A symbolic link planted where the temporary file goes is never followed. */
static void test_tmp_symlink_not_followed(void **state)
{
    (void)state;
    start_in_subdir(NULL);
    char tmp[450];
    snprintf(tmp, sizeof(tmp), "%s.tmp", snap);
    assert_int_equal(th_write_file(copy, "precious", 8), 0);
    assert_int_equal(chmod(copy, 0644), 0);
    assert_int_equal(symlink(copy, tmp), 0);
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    save(fd, 1);
    /* The link's target is untouched; the snapshot is a private regular file. */
    size_t n;
    uint8_t *b = th_read_file(copy, &n);
    assert_int_equal(n, 8);
    assert_memory_equal(b, "precious", 8);
    free(b);
    struct stat st;
    assert_int_equal(stat(copy, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0644);
    assert_int_equal(lstat(snap, &st), 0);
    assert_true(S_ISREG(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0600);
    /* A leftover temporary file from a crash is no obstacle either. */
    unlink(tmp);
    assert_int_equal(th_write_file(tmp, "leftover", 8), 0);
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    save(fd, 2);
    assert_int_equal(lstat(tmp, &st), -1);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    restart_saving(NULL);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), 2);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    subdir_cleanup();
}

/*
 * A --save directory that does not exist, a --save PATH that is a directory, and a --save file
 * another daemon holds.
 */
static void test_save_path_checked_at_start(void **state)
{
    (void)state;
    start_in_subdir(NULL);
    char missing[450];
    snprintf(missing, sizeof(missing), "%s/missing-dir/snap", s.dir);
    const char *a1[] = {"--port", "0", "--save", missing, NULL};
    int st = th_run_tensord(a1, errfile, 5000 * th_slow());
    if (st != 2 || !th_file_contains(errfile, "missing-dir")) {
        print_error("--save in a missing directory: exit %d, want 2 naming it\n", st);
        fail();
    }
    /* A --save PATH that is a directory is a configuration error too, not a damaged file. */
    const char *ad[] = {"--port", "0", "--save", s.dir, NULL};
    st = th_run_tensord(ad, errfile, 5000 * th_slow());
    if (st != 2 || !th_file_contains(errfile, "is a directory")) {
        print_error("--save naming a directory: exit %d, want 2 and \"is a directory\"\n", st);
        fail();
    }
    /* The running daemon holds its --save path: a second one refuses it. */
    const char *a2[] = {"--port", "0", "--save", snap, NULL};
    st = th_run_tensord(a2, errfile, 5000 * th_slow());
    if (st != 2 || !th_file_contains(errfile, "in use")) {
        print_error("a second tensord on the same --save: exit %d, want 2 and \"in use\"\n", st);
        fail();
    }
    /* ... and the first one goes on saving there. */
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    save(fd, 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    /* Once it is gone, the path is free again. */
    restart_saving((const char *const[]){"--save-interval", "0", NULL});
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), 1);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    subdir_cleanup();
}

/* Send op (a name body, or a GET) and expect status. */
static void expect_status(int fd, uint8_t op, const char *name, uint32_t rid, uint16_t status)
{
    if (op == TS_OP_PUT || op == TS_OP_APPEND) {
        size_t len;
        uint8_t *rec = tsu_rec_int(rid, &len);
        assert_int_equal(tsu_send_store(fd, op, rid, name, rec, len), 0);
        tsu_rec_free(rec, len);
    } else if (op == TS_OP_GET || op == TS_OP_PEEK) {
        assert_int_equal(tsu_send_get(fd, op, rid, name, 0), 0);
    } else {
        assert_int_equal(tsu_send_name(fd, op, rid, name, NULL, 0), 0);
    }
    tsu_frame f;
    tsu_expect(fd, &f, op, rid, status);
    if (status == TS_ST_SAVE_FAILING)
        assert_non_null(memmem(f.body, f.len, "snapshot", 8));
    tsu_frame_free(&f);
}

static void test_writes_stop_while_saves_fail(void **state)
{
    (void)state;
    start_in_subdir(NULL);
    int fd = tsu_client(&s);
    tsu_put_int(fd, TS_OP_PUT, "a", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "q", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "q", 2, NULL);
    save(fd, 1);
    assert_int_equal(tsu_stat(fd, "last_save_ok"), 1);
    break_dir();
    /* Until a snapshot fails, writes go on. */
    tsu_put_int(fd, TS_OP_PUT, "b", 2, NULL);
    assert_int_equal(tsh_send(fd, TS_OP_SAVE, 2, NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_SAVE, 2, TS_ST_INTERNAL);
    tsu_frame_free(&f);
    /* Now every request that changes data is refused, and says why; reads go on. */
    expect_status(fd, TS_OP_PUT, "c", 10, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_APPEND, "q", 11, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_GET, "q", 12, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_DELETE, "a", 13, TS_ST_SAVE_FAILING);
    expect_status(fd, TS_OP_PEEK, "q", 14, TS_ST_OK);
    assert_int_equal(tsh_send(fd, TS_OP_PING, 15, NULL, 0), 0);
    tsu_expect(fd, &f, TS_OP_PING, 15, TS_ST_OK);
    tsu_frame_free(&f);
    /* A large refused upload is skipped whole: the connection stays usable. */
    size_t blen;
    uint8_t *big = tsu_rec_bytes((size_t)1 << 20, 3, &blen);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 16, "big", big, blen), 0);
    tsu_rec_free(big, blen);
    tsu_expect(fd, &f, TS_OP_PUT, 16, TS_ST_SAVE_FAILING);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "last_save_ok"), 0);
    assert_true(tsu_stat(fd, "save_failures_consecutive") >= 1);
    assert_true(tsu_stat(fd, "writes_refused") >= 5);
    assert_true(tsu_stat(fd, "last_save_time") > 0);
    /* The library reports it as its own error. */
    ts_client_t *c;
    assert_int_equal(ts_client_open(&c, s.addr, NULL), 0);
    ts_value_t *v = ts_int_new(5);
    assert_int_equal(ts_put(c, "lib", v, NULL), TS_ESAVEFAIL);
    ts_value_free(v);
    /* The directory comes back: a snapshot succeeds, and writes are accepted again. */
    mend_dir();
    save(fd, 20);
    assert_int_equal(tsu_stat(fd, "last_save_ok"), 1);
    assert_int_equal(tsu_stat(fd, "save_failures_consecutive"), 0);
    tsu_put_int(fd, TS_OP_PUT, "c", 3, NULL);
    v = ts_int_new(6);
    assert_int_equal(ts_put(c, "lib", v, NULL), 0);
    ts_value_free(v);
    ts_client_free(c);
    expect_status(fd, TS_OP_DELETE, "a", 21, TS_ST_OK);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    subdir_cleanup();
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
    ts_client_options_t o;
    ts_client_options_init(&o);
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
    uint8_t *after = th_read_file(copy, &n);
    assert_int_equal(n, len);
    assert_memory_equal(after, data, len);
    free(after);
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
    uint8_t *good = th_read_file(snap, &len);
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
    free(good);
}

/*
 * A --save path that is a FIFO is refused at start (exit 3, naming it) rather than waiting
 * forever for a writer to open it.
 */
static void test_fifo_snapshot_refused(void **state)
{
    (void)state;
    start_saving(NULL);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(mkfifo(copy, 0600), 0);
    const char *args[] = {"--port", "0", "--save", copy, NULL};
    int st = th_run_tensord(args, errfile, 5000 * th_slow());
    if (st != 3 || !th_file_contains(errfile, copy) ||
        !th_file_contains(errfile, "not a regular file")) {
        print_error("--save naming a FIFO: exit %d, want 3 and \"not a regular file\"\n", st);
        fail();
    }
    struct stat sb;
    assert_int_equal(lstat(copy, &sb), 0);
    assert_true(S_ISFIFO(sb.st_mode));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_clean_shutdown_keeps_everything, kill_leftover),
        cmocka_unit_test_teardown(test_records_around_the_write_buffer, kill_leftover),
        cmocka_unit_test_teardown(test_save_request, kill_leftover),
        cmocka_unit_test_teardown(test_save_failure_reported, kill_leftover),
        cmocka_unit_test_teardown(test_tmp_symlink_not_followed, kill_leftover),
        cmocka_unit_test_teardown(test_save_path_checked_at_start, kill_leftover),
        cmocka_unit_test_teardown(test_writes_stop_while_saves_fail, kill_leftover),
        cmocka_unit_test_teardown(test_sigkill_under_load, kill_leftover),
        cmocka_unit_test_teardown(test_damaged_snapshots_refused, kill_leftover),
        cmocka_unit_test_teardown(test_fifo_snapshot_refused, kill_leftover),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
