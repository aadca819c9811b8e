/*
 * tensord --data-dir: items in memory-mapped files survive a clean restart and a SIGKILL with
 * equal bytes and versions; items taken by GET, replaced by PUT or deleted do not come back; a
 * damaged file (truncated, a header byte flipped, a bad record) is refused with one log line
 * naming it and the reason, and renamed, while the others load; --max-disk refuses a write
 * (OUT_OF_MEMORY, the connection stays open); a second tensord on the same directory and
 * --data-dir with --save are refused (exit status 2); --data-min keeps small items in memory;
 * a tensor bin's file keeps its rows and comes back as a tensor bin; GET_REF and PEEK_REF send
 * the item's file as a read-only descriptor, and an item GET_REF took stays gone; items in files
 * count against --max-disk, not --max-memory; bins stored by ADD, PUT_IF and a parameter server
 * push are in files too and survive a SIGKILL with their values and versions.
 */
#define _GNU_SOURCE /* memmem */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "msg.h"
#include "tensorshare/coord.h"
#include "tensorshare/ps.h"
#include "tensorshare/tensorshare.h"
#include "record.h"
#include "test_harden_util.h"

#define HDR 4096 /* bytes of a data file's header (server/datadir.c) */

static tsh_server s;
static char ddir[300];    /* the data directory, inside the harness's directory */
static char logfile[320]; /* the daemon's stderr, when a test reads it */
static const char *xargs[16];

/* Remove every file of ddir, then ddir. */
static void rm_ddir(void)
{
    DIR *d = opendir(ddir);
    if (d == NULL)
        return;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char p[600];
        snprintf(p, sizeof(p), "%s/%s", ddir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(ddir);
}

static int teardown(void **state)
{
    (void)state;
    if (s.pid > 0)
        tsh_server_kill(&s);
    if (s.dir[0] != '\0') {
        rm_ddir();
        unlink(logfile);
        tsh_server_cleanup(&s);
    }
    memset(&s, 0, sizeof(s));
    ddir[0] = logfile[0] = '\0';
    return 0;
}

/* args = "--data-dir" ddir + extra (NULL-terminated) into xargs. */
static const char *const *with_dir(const char *const *extra)
{
    int n = 0;
    xargs[n++] = "--data-dir";
    xargs[n++] = ddir;
    for (int i = 0; extra != NULL && extra[i] != NULL && n < 15; i++)
        xargs[n++] = extra[i];
    xargs[n] = NULL;
    return xargs;
}

/*
 * (Re)start tensord on ddir with extra flags; its stderr goes to logfile (truncated) when
 * log is set, so that the test can read what it logged.
 */
static void restart(const char *const *extra, int log)
{
    int saved = -1;
    if (log) {
        fflush(stderr);
        saved = dup(2);
        assert_true(saved >= 0);
        int lfd = open(logfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        assert_true(lfd >= 0);
        assert_int_equal(dup2(lfd, 2), 2);
        close(lfd);
    }
    int rc = tsh_server_restart(&s, with_dir(extra));
    if (log) {
        fflush(stderr);
        dup2(saved, 2);
        close(saved);
    }
    assert_int_equal(rc, 0);
}

/* Start tensord with --data-dir <its dir>/data (not yet made: tensord makes it). */
static void start(const char *const *extra)
{
    /* The directory is only known once the harness has made it: start, then restart. */
    assert_int_equal(tsh_server_start(&s, NULL), 0);
    assert_int_equal(tsh_server_stop(&s), 0);
    snprintf(ddir, sizeof(ddir), "%s/data", s.dir);
    snprintf(logfile, sizeof(logfile), "%s/tensord.log", s.dir);
    restart(extra, 0);
    struct stat st;
    assert_int_equal(stat(ddir, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    assert_int_equal(st.st_mode & 0777, 0700);
}

/* Files in ddir whose names end with suffix. */
static int count_files(const char *suffix)
{
    DIR *d = opendir(ddir);
    assert_non_null(d);
    int n = 0;
    size_t sl = strlen(suffix);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t l = strlen(e->d_name);
        if (l > sl && strcmp(e->d_name + l - sl, suffix) == 0)
            n++;
    }
    closedir(d);
    return n;
}

/* The path (into out) of the .tsi file holding an item of bin name; 0 when found. */
static int file_of_bin(const char *name, char *out, size_t cap)
{
    DIR *d = opendir(ddir);
    assert_non_null(d);
    int found = -1;
    struct dirent *e;
    while (found != 0 && (e = readdir(d)) != NULL) {
        size_t l = strlen(e->d_name);
        if (l < 5 || strcmp(e->d_name + l - 4, ".tsi") != 0)
            continue;
        snprintf(out, cap, "%s/%s", ddir, e->d_name);
        int fd = open(out, O_RDONLY);
        assert_true(fd >= 0);
        uint8_t h[HDR];
        assert_int_equal(pread(fd, h, sizeof(h), 0), (ssize_t)sizeof(h));
        close(fd);
        if (h[48] == strlen(name) && memcmp(h + 49, name, h[48]) == 0)
            found = 0;
    }
    closedir(d);
    return found;
}

/* PEEK name and check it holds exactly rec (one item) at version v (0: any). */
static void expect_item(int fd, const char *name, const uint8_t *rec, size_t len, uint64_t v)
{
    tsu_items it;
    tsu_get(fd, TS_OP_PEEK, name, 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.item_len[0], len);
    assert_memory_equal(it.item[0], rec, len);
    if (v != 0)
        assert_int_equal(it.version, v);
    tsu_frame_free(&it.f);
}

static void expect_missing(int fd, const char *name)
{
    assert_int_equal(tsu_send_get(fd, TS_OP_PEEK, 77, name, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PEEK, 77, TS_ST_NOT_FOUND);
    tsu_frame_free(&f);
}

/* Puts of a large and a small record and a queue survive a clean stop and a SIGKILL. */
static void test_survives_restart_and_kill(void **state)
{
    (void)state;
    start(NULL);
    int fd = tsu_client(&s);
    size_t blen, slen;
    uint8_t *big = tsu_rec_bytes((size_t)3 << 20, 11, &blen);
    uint8_t *small = tsu_rec_bytes(100, 12, &slen);
    uint64_t vb = tsu_store(fd, TS_OP_PUT, "big", big, blen, NULL);
    uint64_t vs = tsu_store(fd, TS_OP_PUT, "small", small, slen, NULL);
    uint64_t vq = 0;
    for (int i = 0; i < 3; i++)
        vq = tsu_put_int(fd, TS_OP_APPEND, "queue", 40 + i, NULL);
    assert_int_equal(tsu_stat(fd, "disk_files"), 5);
    assert_true(tsu_stat(fd, "disk_bytes") >= (int64_t)(5 * HDR + blen));
    close(fd);
    assert_int_equal(count_files(".tsi"), 5);

    for (int round = 0; round < 2; round++) {
        if (round == 0)
            assert_int_equal(tsh_server_stop(&s), 0);
        else
            tsh_server_kill(&s); /* acknowledged items are in the page cache of the files */
        restart(NULL, 0);
        fd = tsu_client(&s);
        assert_int_equal(tsu_stat(fd, "disk_loaded"), 5);
        assert_int_equal(tsu_stat(fd, "disk_damaged"), 0);
        assert_true(tsu_stat(fd, "version") >= (int64_t)vq);
        expect_item(fd, "big", big, blen, vb);
        expect_item(fd, "small", small, slen, vs);
        tsu_items it;
        tsu_get(fd, TS_OP_PEEK, "queue", 0, &it);
        assert_int_equal(it.n, 3);
        assert_int_equal(it.version, vq);
        for (uint32_t i = 0; i < 3; i++)
            assert_int_equal(tsu_item_int(it.item[i], it.item_len[i]), 40 + (int)i);
        tsu_frame_free(&it.f);
        close(fd);
    }
    /* Writes after a restart get versions above every loaded one. */
    fd = tsu_client(&s);
    assert_true(tsu_put_int(fd, TS_OP_PUT, "later", 1, NULL) > vq);
    close(fd);
    tsu_rec_free(big, blen);
    tsu_rec_free(small, slen);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* Wait (up to 2 s) until STATS key equals want: replies still being written hold their items. */
static void wait_stat(int fd, const char *key, int64_t want)
{
    int64_t v = -1;
    for (int i = 0; i < 200; i++) {
        v = tsu_stat(fd, key);
        if (v == want)
            return;
        th_sleep_ms(10);
    }
    assert_int_equal(v, want);
}

/* Items taken by GET, replaced by PUT or deleted stay gone after a SIGKILL. */
static void test_taken_items_stay_gone(void **state)
{
    (void)state;
    start(NULL);
    int fd = tsu_client(&s);
    for (int i = 0; i < 3; i++)
        tsu_put_int(fd, TS_OP_APPEND, "q", i, NULL);
    tsu_put_int(fd, TS_OP_PUT, "r", 1, NULL);
    tsu_put_int(fd, TS_OP_APPEND, "r", 2, NULL);
    uint64_t vr = tsu_put_int(fd, TS_OP_PUT, "r", 3, NULL);
    tsu_put_int(fd, TS_OP_PUT, "d", 4, NULL);
    size_t blen;
    uint8_t *big = tsu_rec_bytes((size_t)1 << 20, 5, &blen);
    tsu_store(fd, TS_OP_PUT, "gone", big, blen, NULL);
    /* GET the oldest of q, and the big item whole. */
    tsu_items it;
    tsu_get(fd, TS_OP_GET, "q", 1, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 0);
    tsu_frame_free(&it.f);
    tsu_get(fd, TS_OP_GET, "gone", 0, &it);
    assert_int_equal(it.n, 1);
    tsu_frame_free(&it.f);
    assert_int_equal(tsu_send_name(fd, TS_OP_DELETE, 9, "d", NULL, 0), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_DELETE, 9, TS_ST_OK);
    tsu_frame_free(&f);
    /* q: 2 items, r: 1 item; nothing else is held once every reply is written. */
    wait_stat(fd, "disk_files", 3);
    close(fd);
    assert_int_equal(count_files(".tsi"), 3);
    tsh_server_kill(&s);

    restart(NULL, 0);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "bins"), 2);
    assert_int_equal(tsu_stat(fd, "disk_loaded"), 3);
    tsu_get(fd, TS_OP_PEEK, "q", 0, &it);
    assert_int_equal(it.n, 2);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 1);
    assert_int_equal(tsu_item_int(it.item[1], it.item_len[1]), 2);
    tsu_frame_free(&it.f);
    tsu_get(fd, TS_OP_PEEK, "r", 0, &it);
    assert_int_equal(it.n, 1);
    assert_int_equal(it.version, vr);
    assert_int_equal(tsu_item_int(it.item[0], it.item_len[0]), 3);
    tsu_frame_free(&it.f);
    expect_missing(fd, "d");
    expect_missing(fd, "gone");
    close(fd);
    tsu_rec_free(big, blen);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(count_files(".gone"), 0);
}

/* Write len bytes at off of path. */
static void poke(const char *path, off_t off, const void *b, size_t len)
{
    int fd = open(path, O_WRONLY);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, b, len, off), (ssize_t)len);
    close(fd);
}

/* Truncated, flipped and bad-record files are refused one by one; the rest loads. */
static void test_damaged_files_refused(void **state)
{
    (void)state;
    start(NULL);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(20000, 3, &len);
    const char *names[] = {"ok", "cut", "flip", "badrec"};
    for (int i = 0; i < 4; i++)
        tsu_store(fd, TS_OP_PUT, names[i], rec, len, NULL);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);

    char cut[600], flip[600], badrec[600], stray[600];
    assert_int_equal(file_of_bin("cut", cut, sizeof(cut)), 0);
    assert_int_equal(file_of_bin("flip", flip, sizeof(flip)), 0);
    assert_int_equal(file_of_bin("badrec", badrec, sizeof(badrec)), 0);
    assert_int_equal(truncate(cut, HDR + 100), 0);
    uint8_t b;
    int f = open(flip, O_RDWR);
    assert_true(f >= 0);
    assert_int_equal(pread(f, &b, 1, 30), 1);
    b ^= 0x40;
    assert_int_equal(pwrite(f, &b, 1, 30), 1);
    close(f);
    /* The record's own header (magic) is broken; the file header stays good. */
    static const uint8_t junk[16] = {0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    poke(badrec, HDR, junk, sizeof(junk));
    /* An upload cut off before it was stored: a file whose header is still zero. */
    snprintf(stray, sizeof(stray), "%s/00000000000fffff.tsi", ddir);
    uint8_t *zero = calloc(1, HDR + 64);
    assert_non_null(zero);
    assert_int_equal(th_write_file(stray, zero, HDR + 64), 0);
    free(zero);

    restart(NULL, 1);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "disk_loaded"), 1);
    assert_int_equal(tsu_stat(fd, "disk_damaged"), 3);
    expect_item(fd, "ok", rec, len, 0);
    expect_missing(fd, "cut");
    expect_missing(fd, "flip");
    expect_missing(fd, "badrec");
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    /* One line per file, naming it and the reason; the files are kept aside, renamed. */
    const char *base[3] = {strrchr(cut, '/') + 1, strrchr(flip, '/') + 1, strrchr(badrec, '/') + 1};
    const char *why[3] = {"truncated", "header checksum mismatch", "fails validation"};
    for (int i = 0; i < 3; i++) {
        char line[700];
        snprintf(line, sizeof(line), "refusing %s/%s: ", ddir, base[i]);
        assert_true(th_file_contains(logfile, line));
        assert_true(th_file_contains(logfile, why[i]));
        char moved[700];
        snprintf(moved, sizeof(moved), "%s/%s.damaged", ddir, base[i]);
        assert_int_equal(access(moved, F_OK), 0);
    }
    assert_true(th_file_contains(logfile, "an upload that never completed"));
    assert_int_not_equal(access(stray, F_OK), 0);
    assert_int_equal(count_files(".tsi"), 1);
    assert_int_equal(count_files(".tsi.damaged"), 3);
    tsu_rec_free(rec, len);
}

/* A write past --max-disk is refused OUT_OF_MEMORY; the connection stays open. */
static void test_max_disk_refuses(void **state)
{
    (void)state;
    const char *extra[] = {"--max-disk", "64k", NULL};
    start(extra);
    int fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "max_disk"), 64 << 10);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(100 << 10, 9, &len);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 5, "big", rec, len), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_PUT, 5, TS_ST_OUT_OF_MEMORY);
    assert_non_null(f.body);
    assert_non_null(memmem(f.body, f.len, "--max-disk", 10));
    tsu_frame_free(&f);
    /* The same connection goes on: a small item fits. */
    tsu_put_int(fd, TS_OP_PUT, "small", 7, NULL);
    assert_int_equal(tsu_stat(fd, "disk_refused"), 1);
    assert_int_equal(tsu_stat(fd, "disk_files"), 1);
    expect_missing(fd, "big");
    close(fd);
    tsu_rec_free(rec, len);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(count_files(".tsi"), 1);
}

/* A second tensord on the same directory, and --data-dir with --save, exit 2. */
static void test_lock_and_exclusive_flags(void **state)
{
    (void)state;
    start(NULL);
    char err[400];
    snprintf(err, sizeof(err), "%s/second.err", s.dir);
    const char *second[] = {"--port", "0", "--data-dir", ddir, NULL};
    assert_int_equal(th_run_tensord(second, err, 15000), 2);
    assert_true(th_file_contains(err, "another tensord is using it"));
    char snap[400];
    snprintf(snap, sizeof(snap), "%s/snap", s.dir);
    const char *both[] = {"--port", "0", "--data-dir", ddir, "--save", snap, NULL};
    assert_int_equal(th_run_tensord(both, err, 15000), 2);
    assert_true(th_file_contains(err, "--data-dir and --save cannot be used together"));
    /* The first one is untouched. */
    tsu_check_healthy(&s);
    unlink(err);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* --data-min: smaller items stay in memory (gone after a restart), larger ones in files. */
static void test_data_min_splits(void **state)
{
    (void)state;
    const char *extra[] = {"--data-min", "64k", NULL};
    start(extra);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_bytes(128 << 10, 21, &len);
    tsu_store(fd, TS_OP_PUT, "large", rec, len, NULL);
    tsu_put_int(fd, TS_OP_PUT, "tiny", 5, NULL);
    assert_int_equal(tsu_stat(fd, "disk_files"), 1);
    close(fd);
    tsh_server_kill(&s);
    restart(extra, 0);
    fd = tsu_client(&s);
    expect_item(fd, "large", rec, len, 0);
    expect_missing(fd, "tiny");
    close(fd);
    tsu_rec_free(rec, len);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* WRITE_ROWS of rows [start, start + 2) of a float32 [*, 4] tensor bin, every value v. */
static void write_two_rows(int fd, uint32_t rid, const char *name, int64_t start, float v)
{
    ts_value_t *m = ts_map_new();
    int64_t shape[2] = {2, 4};
    ts_value_t *t = ts_tensor_alloc(TS_FLOAT32, 2, shape);
    assert_non_null(t);
    float *d = ts_value_tensor(t)->data;
    for (int i = 0; i < 8; i++)
        d[i] = v;
    assert_int_equal(ts_map_set(m, "start", ts_int_new(start)), 0);
    assert_int_equal(ts_map_set(m, "rows", t), 0);
    uint8_t *rec;
    size_t rlen;
    assert_int_equal(ts__record_encode(m, &rec, &rlen), 0);
    ts_value_free(m);
    assert_int_equal(tsu_send_store(fd, TS_OP_WRITE_ROWS, rid, name, rec, rlen), 0);
    ts__free_aligned(rec, rlen);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_WRITE_ROWS, rid, TS_ST_OK);
    tsu_frame_free(&f);
}

/*
 * A tensor bin in a file: rows written in place survive a SIGKILL, it is a tensor bin again, and
 * rows written after the restart go to the same file (and survive the next SIGKILL).
 */
static void test_tensor_bin_survives(void **state)
{
    (void)state;
    start(NULL);
    int fd = tsu_client(&s);
    ts__msg_tensor_bin_req tb = {
        .name = (const uint8_t *)"tb", .name_len = 2, .dtype = TS_FLOAT32, .ndim = 2};
    tb.dims[0] = 64;
    tb.dims[1] = 4;
    uint8_t body[512];
    size_t blen;
    assert_int_equal(ts__msg_tensor_bin_req_encode(body, sizeof(body), &tb, &blen), 0);
    assert_int_equal(tsh_send(fd, TS_OP_TENSOR_BIN, 3, body, blen), 0);
    tsu_frame f;
    tsu_expect(fd, &f, TS_OP_TENSOR_BIN, 3, TS_ST_OK);
    tsu_frame_free(&f);
    assert_int_equal(tsu_stat(fd, "disk_files"), 1);
    for (int round = 0; round < 2; round++) {
        /* Round 0: rows 10 and 11 get 7.5; round 1 (after a restart): rows 20 and 21 get -1. */
        write_two_rows(fd, 4, "tb", round == 0 ? 10 : 20, round == 0 ? 7.5f : -1.0f);
        tsu_items before;
        tsu_get(fd, TS_OP_PEEK, "tb", 0, &before);
        assert_int_equal(before.n, 1);
        close(fd);
        tsh_server_kill(&s);
        restart(NULL, 0);
        fd = tsu_client(&s);
        expect_item(fd, "tb", before.item[0], before.item_len[0], 0);
        tsu_frame_free(&before.f);
        assert_int_equal(tsu_stat(fd, "disk_files"), 1);
    }
    /* A tensor bin again: PUT is refused. */
    size_t ilen;
    uint8_t *irec = tsu_rec_int(1, &ilen);
    assert_int_equal(tsu_send_store(fd, TS_OP_PUT, 5, "tb", irec, ilen), 0);
    tsu_rec_free(irec, ilen);
    tsu_expect(fd, &f, TS_OP_PUT, 5, TS_ST_INVALID);
    tsu_frame_free(&f);
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/*
 * Items in files count against --max-disk, not --max-memory: bins may hold more than the memory
 * limit (an upload still reserves memory while its bytes arrive).
 */
static void test_beyond_max_memory(void **state)
{
    (void)state;
    const char *extra[] = {"--max-memory", "8m", NULL};
    start(extra);
    int fd = tsu_client(&s);
    size_t len;
    uint8_t *rec = tsu_rec_bytes((size_t)3 << 20, 8, &len);
    for (int i = 0; i < 5; i++) {
        char name[16];
        snprintf(name, sizeof(name), "w%d", i);
        tsu_store(fd, TS_OP_PUT, name, rec, len, NULL);
    }
    assert_true(tsu_stat(fd, "disk_bytes") > (int64_t)(5 * len));
    assert_true(tsu_stat(fd, "used_memory") < (int64_t)len);
    expect_item(fd, "w4", rec, len, 0);
    close(fd);
    tsu_rec_free(rec, len);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* The tensor "t" of a tsu_rec_bytes(n, seed) record holds its bytes. */
static void check_rec_bytes(const ts_value_t *root, size_t n, unsigned seed)
{
    assert_non_null(root);
    const ts_value_t *tv = ts_map_get(root, "t");
    assert_non_null(tv);
    const ts_tensor_t *t = ts_value_tensor(tv);
    assert_non_null(t);
    assert_int_equal(t->shape[0], (int64_t)n);
    const uint8_t *d = t->data;
    for (size_t i = 0; i < n; i++)
        if (d[i] != (uint8_t)((i + seed) & 0xff))
            fail_msg("byte %zu differs", i);
}

/*
 * By reference on the same host: the item's file goes as a read-only descriptor (record at 4096),
 * also when GET_REF takes the item out of its bin, and the item stays gone after a SIGKILL.
 */
static void test_by_reference(void **state)
{
    (void)state;
    start(NULL);
    int fd = tsu_client(&s);
    size_t n = (size_t)2 << 20, len;
    uint8_t *rec = tsu_rec_bytes(n, 33, &len);
    tsu_store(fd, TS_OP_PUT, "ref", rec, len, NULL);
    tsu_rec_free(rec, len);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, s.unix_addr, NULL), 0);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek_ref(c, "ref", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    check_rec_bytes(ts_items_at(items, 0), n, 33);
    ts_items_free(items);
    items = NULL;
    assert_int_equal(ts_get_ref(c, "ref", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    check_rec_bytes(ts_items_at(items, 0), n, 33);
    ts_items_free(items);
    assert_true(tsu_stat(fd, "fds_sent") >= 2);
    ts_client_free(c);
    expect_missing(fd, "ref");
    wait_stat(fd, "disk_files", 0);
    close(fd);
    tsh_server_kill(&s);
    restart(NULL, 0);
    fd = tsu_client(&s);
    expect_missing(fd, "ref");
    close(fd);
    assert_int_equal(tsh_server_stop(&s), 0);
    assert_int_equal(count_files(".tsi") + count_files(".gone"), 0);
}

/*
 * A shared-buffer put (PUT_FD) with --data-dir lands in a file like any other put, so it survives
 * a SIGKILL with equal bytes.
 */
static void test_shared_put_survives(void **state)
{
    (void)state;
    start(NULL);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, s.unix_addr, NULL), 0);
    int64_t n = 1 << 18; /* float32 elements: 1 MiB */
    ts_value_t *layout = ts_tensor_spec_new(TS_FLOAT32, 1, &n);
    assert_non_null(layout);
    ts_shared_t *sh = NULL;
    assert_int_equal(ts_shared_new(layout, &sh), 0);
    ts_value_free(layout);
    float *f = ts_value_tensor(ts_shared_value(sh))->data;
    for (int64_t i = 0; i < n; i++)
        f[i] = (float)i * 0.5f;
    assert_int_equal(ts_shared_put(c, "shared", sh, NULL), 0);
    ts_shared_free(sh);
    int fd = tsu_client(&s);
    assert_true(tsu_stat(fd, "puts_fd") >= 1);
    wait_stat(fd, "disk_files", 1);
    close(fd);
    ts_client_free(c);
    tsh_server_kill(&s);
    restart(NULL, 0);
    assert_int_equal(ts_client_open(&c, s.addr, NULL), 0);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(c, "shared", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(t);
    assert_int_equal(t->shape[0], n);
    const float *g = t->data;
    for (int64_t i = 0; i < n; i++)
        if (g[i] != (float)i * 0.5f)
            fail_msg("element %lld differs after the restart", (long long)i);
    ts_items_free(items);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s), 0);
}

/* PEEK bin name through c: its one item's float32 tensor of n elements into out, its version. */
static uint64_t peek_floats(ts_client_t *c, const char *name, float *out, int64_t n)
{
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(c, name, 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    const ts_tensor_t *t = ts_value_tensor(ts_items_at(items, 0));
    assert_non_null(t);
    assert_true(t->dtype == TS_FLOAT32 && t->ndim == 1 && t->shape[0] == n);
    memcpy(out, t->data, (size_t)n * sizeof(float));
    uint64_t v = ts_items_version(items);
    ts_items_free(items);
    return v;
}

/*
 * Every way an item is stored into a bin puts it in a file: a counter (ADD), a PUT_IF that makes
 * a bin and one that replaces a PUT's item, and the value a parameter server push publishes.
 * All of them survive a SIGKILL with their values and versions.
 */
static void test_every_store_survives(void **state)
{
    (void)state;
    enum { N = 1 << 16 }; /* float32 elements: 256 KiB */
    start(NULL);
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, s.addr, NULL), 0);
    static float a[N], b[N], w[N], g[N], got[N];
    for (int i = 0; i < N; i++) {
        a[i] = (float)i;
        b[i] = (float)i * 2.0f;
        w[i] = 1.0f;
        g[i] = 0.5f;
    }
    int64_t n = N;
    ts_value_t *ta = ts_tensor_new(TS_FLOAT32, 1, &n, a, TS_BORROW);
    ts_value_t *tb = ts_tensor_new(TS_FLOAT32, 1, &n, b, TS_BORROW);
    ts_value_t *tw = ts_tensor_new(TS_FLOAT32, 1, &n, w, TS_BORROW);
    assert_true(ta != NULL && tb != NULL && tw != NULL);

    int64_t value = 0;
    uint64_t v_ctr = 0, v_new = 0, v_old = 0, v_w = 0;
    for (int i = 0; i < 3; i++)
        assert_int_equal(ts_add(c, "ctr", 5, &value, &v_ctr), 0);
    assert_int_equal(value, 15);
    assert_int_equal(ts_put_if(c, "new", 0, ta, &v_new), 0);
    assert_int_equal(ts_put(c, "old", ta, &v_old), 0);
    assert_int_equal(ts_put_if(c, "old", v_old, tb, &v_old), 0);
    /* A refused PUT_IF leaves its bin's file alone and makes none. */
    uint64_t cur = 0;
    assert_int_equal(ts_put_if(c, "old", 1, ta, &cur), TS_ECONFLICT);
    assert_int_equal(cur, v_old);
    assert_int_equal(ts_put(c, "w", tw, NULL), 0);
    ts_ps_options_t o;
    ts_ps_options_init(&o);
    o.optimizer = TS_PS_SGD;
    o.lr = 1.0;
    assert_int_equal(ts_ps_create(c, "w", &o, NULL), 0);
    ts_tensor_t grad = {.data = g, .dtype = TS_FLOAT32, .ndim = 1, .shape = {N}};
    assert_int_equal(ts_ps_push(c, "w", &grad, 0, 1.0, &v_w), 0);
    assert_int_equal(ts_ps_push(c, "w", &grad, 0, 1.0, &v_w), 0);
    assert_int_equal(peek_floats(c, "w", got, N), v_w);
    assert_true(got[0] == 0.0f && got[N - 1] == 0.0f);
    ts_client_free(c);
    ts_value_free(ta);
    ts_value_free(tb);
    ts_value_free(tw);
    int fd = tsu_client(&s);
    wait_stat(fd, "disk_files", 4); /* one item per bin: replaced ones are gone */
    close(fd);
    assert_int_equal(count_files(".tsi"), 4);

    tsh_server_kill(&s);
    restart(NULL, 0);
    fd = tsu_client(&s);
    assert_int_equal(tsu_stat(fd, "disk_loaded"), 4);
    assert_int_equal(tsu_stat(fd, "disk_damaged"), 0);
    close(fd);
    assert_int_equal(ts_client_open(&c, s.addr, NULL), 0);
    ts_items_t *items = NULL;
    assert_int_equal(ts_peek(c, "ctr", 0, &items), 0);
    assert_int_equal(ts_items_count(items), 1);
    assert_int_equal(ts_value_int(ts_items_at(items, 0), &value), 0);
    assert_int_equal(value, 15);
    assert_int_equal(ts_items_version(items), v_ctr);
    ts_items_free(items);
    assert_int_equal(peek_floats(c, "new", got, N), v_new);
    assert_memory_equal(got, a, sizeof(a));
    assert_int_equal(peek_floats(c, "old", got, N), v_old);
    assert_memory_equal(got, b, sizeof(b));
    assert_int_equal(peek_floats(c, "w", got, N), v_w);
    for (int i = 0; i < N; i++)
        if (got[i] != 0.0f)
            fail_msg("w[%d] is %g after the restart, not 0", i, (double)got[i]);
    /* The counter goes on from its value. */
    assert_int_equal(ts_add(c, "ctr", 1, &value, NULL), 0);
    assert_int_equal(value, 16);
    ts_client_free(c);
    assert_int_equal(tsh_server_stop(&s), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_teardown(test_survives_restart_and_kill, teardown),
        cmocka_unit_test_teardown(test_taken_items_stay_gone, teardown),
        cmocka_unit_test_teardown(test_damaged_files_refused, teardown),
        cmocka_unit_test_teardown(test_max_disk_refuses, teardown),
        cmocka_unit_test_teardown(test_lock_and_exclusive_flags, teardown),
        cmocka_unit_test_teardown(test_data_min_splits, teardown),
        cmocka_unit_test_teardown(test_tensor_bin_survives, teardown),
        cmocka_unit_test_teardown(test_by_reference, teardown),
        cmocka_unit_test_teardown(test_shared_put_survives, teardown),
        cmocka_unit_test_teardown(test_beyond_max_memory, teardown),
        cmocka_unit_test_teardown(test_every_store_survives, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
