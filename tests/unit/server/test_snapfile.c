/*
 * tensord's snapshot file format (server/snapfile.c), linked alone, without the loop or the
 * store: files written by tensord before the format had a file of its own still load and are
 * written again byte for byte; a round trip keeps every bin and item; a file cut short at any
 * byte, a byte flipped anywhere, and lengths, counts and fields that lie (with their checksums
 * made right) are refused with a message, never read past their end nor allowed to ask for
 * more memory than the file holds.
 */
#define _GNU_SOURCE /* memfd_create */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "record.h"
#include "snapfile.h"
#include "snapfile_fix.h"

#define LABEL "t.snap"
/* Bytes of the test's largest record: above half the writer's 1 MiB buffer, written directly. */
#define BIG_FLOATS (200 * 1024)

/* What the reader handed over. */
typedef struct sink_state {
    tsd_snapfile_bin bins[64];
    uint8_t names[64][TS_MAX_NAME_LEN];
    size_t n_bins;
    uint8_t *items[64];
    size_t lens[64];
    size_t n_items;
    uint64_t asked; /* item bytes asked for */
    int refuse_bin, refuse_item;
} sink_state;

static int on_bin(void *arg, const uint8_t *name, size_t name_len, uint64_t version,
                  uint32_t n_items)
{
    sink_state *s = arg;
    if (s->refuse_bin)
        return -1;
    assert_true(s->n_bins < 64);
    assert_true(name_len <= TS_MAX_NAME_LEN);
    memcpy(s->names[s->n_bins], name, name_len);
    s->bins[s->n_bins] = (tsd_snapfile_bin){.name = s->names[s->n_bins],
                                            .first = s->n_items,
                                            .version = version,
                                            .n_items = n_items,
                                            .name_len = (uint8_t)name_len};
    s->n_bins++;
    return 0;
}

static uint8_t *on_item(void *arg, size_t len)
{
    sink_state *s = arg;
    if (s->refuse_item)
        return NULL;
    assert_true(s->n_items < 64);
    s->asked += len;
    uint8_t *p = ts__malloc(len);
    assert_non_null(p);
    s->items[s->n_items] = p;
    s->lens[s->n_items++] = len;
    return p;
}

static void sink_reset(sink_state *s)
{
    for (size_t i = 0; i < s->n_items; i++)
        ts__free(s->items[i]);
    memset(s, 0, sizeof(*s));
}

static void item_of(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const sink_state *s = arg;
    assert_true(index < s->n_items);
    *data = s->items[index];
    *len = s->lens[index];
}

/* Read p[0..len) into a fresh s; returns the reader's code, err holds its message. */
static int read_mem(const uint8_t *p, size_t len, sink_state *s, tsd_snapfile_head *head, char *err,
                    size_t cap)
{
    memset(s, 0, sizeof(*s));
    tsd_snapfile_sink sink = {.arg = s, .bin = on_bin, .item = on_item};
    err[0] = '\0';
    int rc = tsd_snapfile_read_mem(p, len, LABEL, &sink, head, err, cap);
    /* Whatever the file says, the reader never asks for more than it holds. */
    assert_true(s->asked <= len);
    if (rc != 0)
        assert_ptr_equal(strstr(err, "snapshot " LABEL), err);
    return rc;
}

/* The bytes fd holds, from offset 0, into a new buffer. */
static uint8_t *fd_bytes(int fd, size_t *len)
{
    off_t n = lseek(fd, 0, SEEK_END);
    assert_true(n >= 0);
    uint8_t *b = ts__malloc((size_t)n + 1);
    assert_non_null(b);
    assert_int_equal(pread(fd, b, (size_t)n, 0), n);
    *len = (size_t)n;
    return b;
}

/* A seed of tests/fuzz/corpus/fuzz_snapfile (written by tensord), into a new buffer. */
static uint8_t *seed(const char *name, size_t *len)
{
    const char *src = getenv("TS_SOURCE_DIR");
    char path[1024];
    snprintf(path, sizeof(path), "%s/tests/fuzz/corpus/fuzz_snapfile/%s", src != NULL ? src : ".",
             name);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        print_error("cannot open %s (is TS_SOURCE_DIR set?)\n", path);
    assert_true(fd >= 0);
    uint8_t *b = fd_bytes(fd, len);
    close(fd);
    return b;
}

/* Write what s holds with head into a new memory file; returns its descriptor. */
static int write_mem(sink_state *s, const tsd_snapfile_head *head)
{
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, head, s->bins, item_of, s), 0);
    return fd;
}

static void test_files_written_before_load_and_write_back(void **state)
{
    (void)state;
    static const char *const names[] = {"params", "queue", "weights", "\xc3\xbcn\xc3\xaf"};
    static const uint32_t counts[] = {1, 3, 1, 1};
    size_t len;
    uint8_t *good = seed("four_bins", &len);
    sink_state s;
    tsd_snapfile_head head;
    char err[1024];
    assert_int_equal(read_mem(good, len, &s, &head, err, sizeof(err)), 0);
    assert_int_equal(head.n_bins, 4);
    assert_int_equal(head.n_items, 6);
    assert_int_equal(head.bytes, 1744);
    assert_int_equal(s.n_bins, 4);
    for (size_t b = 0; b < 4; b++) {
        assert_int_equal(s.bins[b].name_len, strlen(names[b]));
        assert_memory_equal(s.bins[b].name, names[b], strlen(names[b]));
        assert_int_equal(s.bins[b].n_items, counts[b]);
        assert_true(s.bins[b].version <= head.counter);
    }
    /* The same contents written now give the same bytes: the format did not change. */
    int fd = write_mem(&s, &head);
    size_t n;
    uint8_t *again = fd_bytes(fd, &n);
    assert_int_equal(n, len);
    assert_memory_equal(again, good, len);
    /* And the descriptor reader agrees with the memory reader. */
    sink_state s2;
    memset(&s2, 0, sizeof(s2));
    tsd_snapfile_sink sink = {.arg = &s2, .bin = on_bin, .item = on_item};
    tsd_snapfile_head h2;
    assert_int_equal(lseek(fd, 0, SEEK_SET), 0);
    assert_int_equal(tsd_snapfile_read_fd(fd, len, LABEL, &sink, &h2, err, sizeof(err)), 0);
    assert_memory_equal(&h2, &head, sizeof(head));
    assert_int_equal(s2.n_items, 6);
    for (size_t i = 0; i < 6; i++)
        assert_memory_equal(s2.items[i], s.items[i], s.lens[i]);
    /* A file of the right size that shrank afterwards: the read meets its end. */
    assert_int_equal(ftruncate(fd, (off_t)len - 10), 0);
    assert_int_equal(lseek(fd, 0, SEEK_SET), 0);
    sink_reset(&s2);
    sink.arg = &s2;
    assert_int_equal(tsd_snapfile_read_fd(fd, len, LABEL, &sink, &h2, err, sizeof(err)), TS_EPROTO);
    assert_non_null(strstr(err, "unexpected end of file"));
    sink_reset(&s2);
    close(fd);
    ts__free(again);
    sink_reset(&s);

    uint8_t *empty = seed("empty", &len);
    assert_int_equal(len, TSD_SNAP_HDR_SIZE + TSD_SNAP_END_SIZE);
    assert_int_equal(read_mem(empty, len, &s, &head, err, sizeof(err)), 0);
    assert_int_equal(head.n_bins, 0);
    assert_int_equal(head.n_items, 0);
    fd = write_mem(&s, &head);
    again = fd_bytes(fd, &n);
    assert_int_equal(n, len);
    assert_memory_equal(again, empty, len);
    close(fd);
    ts__free(again);
    ts__free(empty);
    ts__free(good);
}

/* A float32 record of n elements, each i * scale, in a new buffer (ts__free_aligned). */
static uint8_t *record(int64_t n, float scale, size_t *len)
{
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT32, 1, &n);
    assert_non_null(v);
    float *f = ts_value_tensor(v)->data;
    for (int64_t i = 0; i < n; i++)
        f[i] = (float)i * scale;
    uint8_t *out;
    assert_int_equal(ts__record_encode(v, &out, len), 0);
    ts_value_free(v);
    return out;
}

static void test_round_trip(void **state)
{
    (void)state;
    /* Records from 4 bytes of data to 800 KiB, bins with none, one and several items. */
    static const int64_t sizes[] = {1, 1000, BIG_FLOATS, 3, 17};
    sink_state w;
    memset(&w, 0, sizeof(w));
    for (size_t i = 0; i < TS__ARRAY_SIZE(sizes); i++) {
        size_t len;
        uint8_t *r = record(sizes[i], 0.5f + (float)i, &len);
        w.items[i] = ts__malloc(len);
        assert_non_null(w.items[i]);
        memcpy(w.items[i], r, len);
        w.lens[i] = len;
        ts__free_aligned(r, len);
    }
    w.n_items = TS__ARRAY_SIZE(sizes);
    uint8_t long_name[TS_MAX_NAME_LEN];
    memset(long_name, 'n', sizeof(long_name));
    /* Given out of order; the sort puts "" first and "ab" before "abc" before "b". */
    tsd_snapfile_bin bins[] = {
        {.name = (const uint8_t *)"b", .name_len = 1, .version = 7, .first = 4, .n_items = 1},
        {.name = (const uint8_t *)"abc", .name_len = 3, .version = 5, .first = 1, .n_items = 3},
        {.name = long_name, .name_len = TS_MAX_NAME_LEN, .version = 9, .first = 5},
        {.name = (const uint8_t *)"ab", .name_len = 2, .version = 3, .first = 0, .n_items = 1},
        {.name = (const uint8_t *)"", .name_len = 0, .version = 1, .first = 5},
    };
    tsd_snapfile_sort(bins, TS__ARRAY_SIZE(bins));
    static const char *const order[] = {"", "ab", "abc", "b"};
    for (size_t b = 0; b < 4; b++)
        assert_memory_equal(bins[b].name, order[b], strlen(order[b]));
    assert_int_equal(bins[4].name_len, TS_MAX_NAME_LEN);
    uint64_t bytes = 0;
    for (size_t i = 0; i < w.n_items; i++)
        bytes += w.lens[i];
    tsd_snapfile_head head = {.counter = 42,
                              .n_bins = TS__ARRAY_SIZE(bins),
                              .n_items = w.n_items,
                              .bytes = bytes,
                              .wall_ms = 1234};
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, &head, bins, item_of, &w), 0);
    size_t len;
    uint8_t *file = fd_bytes(fd, &len);
    close(fd);

    sink_state r;
    tsd_snapfile_head got;
    char err[1024];
    int rc = read_mem(file, len, &r, &got, err, sizeof(err));
    if (rc != 0)
        print_error("%s\n", err);
    assert_int_equal(rc, 0);
    assert_memory_equal(&got, &head, sizeof(head));
    assert_int_equal(r.n_bins, TS__ARRAY_SIZE(bins));
    for (size_t b = 0; b < r.n_bins; b++) {
        assert_int_equal(r.bins[b].name_len, bins[b].name_len);
        assert_memory_equal(r.bins[b].name, bins[b].name, bins[b].name_len);
        assert_int_equal(r.bins[b].version, bins[b].version);
        assert_int_equal(r.bins[b].n_items, bins[b].n_items);
        for (uint32_t i = 0; i < bins[b].n_items; i++) {
            size_t a = bins[b].first + i, c = r.bins[b].first + i;
            assert_int_equal(r.lens[c], w.lens[a]);
            assert_memory_equal(r.items[c], w.items[a], w.lens[a]);
        }
    }
    sink_reset(&r);
    sink_reset(&w);
    ts__free(file);
}

static void test_truncated_at_every_byte(void **state)
{
    (void)state;
    size_t len;
    uint8_t *good = seed("four_bins", &len);
    char err[1024];
    for (size_t cut = 0; cut < len; cut++) {
        /* An exact-size copy, so that a read past its end is caught by ASan. */
        uint8_t *p = ts__malloc(cut + 1);
        assert_non_null(p);
        memcpy(p, good, cut);
        sink_state s;
        tsd_snapfile_head head;
        int rc = read_mem(p, cut, &s, &head, err, sizeof(err));
        if (rc != TS_EPROTO || strstr(err, "truncated") == NULL) {
            print_error("cut at %zu: %d \"%s\"\n", cut, rc, err);
            fail();
        }
        sink_reset(&s);
        ts__free(p);
    }
    ts__free(good);
}

/* The sections of a file, found by walking a good one. */
enum { SEC_MAGIC, SEC_HDR, SEC_BIN_LEN, SEC_BIN, SEC_ITEM, SEC_END, SEC_COUNT };

static void sections(const uint8_t *p, size_t len, uint8_t *sec)
{
    memset(sec, SEC_HDR, TSD_SNAP_HDR_SIZE);
    memset(sec, SEC_MAGIC, 8);
    size_t off = TSD_SNAP_HDR_SIZE;
    for (uint64_t b = 0; b < ts__get_u64le(p + 24); b++) {
        size_t nl = p[off];
        uint32_t n = ts__get_u32le(p + off + 1 + nl + 8);
        size_t hl = 17 + nl + (size_t)n * 8;
        memset(sec + off, SEC_BIN, hl + 8);
        /* The lengths: a flip there may make the file look cut short instead. */
        sec[off] = SEC_BIN_LEN;
        memset(sec + off + 1 + nl + 8, SEC_BIN_LEN, 4);
        memset(sec + off + 17 + nl, SEC_BIN_LEN, (size_t)n * 8);
        const uint8_t *lens = p + off + 17 + nl;
        off += hl + 8;
        for (uint32_t i = 0; i < n; i++) {
            size_t il = (size_t)ts__get_u64le(lens + (size_t)i * 8);
            memset(sec + off, SEC_ITEM, il + 8);
            off += il + 8;
        }
    }
    assert_int_equal(len - off, TSD_SNAP_END_SIZE);
    memset(sec + off, SEC_END, TSD_SNAP_END_SIZE);
}

static void test_flipped_byte_in_each_section(void **state)
{
    (void)state;
    static const char *const want[SEC_COUNT] = {
        [SEC_MAGIC] = "bad magic",
        [SEC_HDR] = "checksum mismatch in the file header",
        [SEC_BIN_LEN] = "the header of bin",
        [SEC_BIN] = "checksum mismatch in the header of bin",
        [SEC_ITEM] = "checksum mismatch in item",
        [SEC_END] = "trailer",
    };
    size_t len;
    uint8_t *good = seed("four_bins", &len);
    uint8_t *sec = ts__malloc(len);
    assert_non_null(sec);
    sections(good, len, sec);
    uint8_t *p = ts__malloc(len);
    assert_non_null(p);
    char err[1024];
    unsigned seen[SEC_COUNT] = {0};
    for (size_t off = 0; off < len; off++) {
        for (int bit = 0; bit < 8; bit += 7) {
            memcpy(p, good, len);
            p[off] ^= (uint8_t)(1u << bit);
            sink_state s;
            tsd_snapfile_head head;
            int rc = read_mem(p, len, &s, &head, err, sizeof(err));
            int ok = rc == TS_EPROTO && strstr(err, want[sec[off]]) != NULL;
            /* A length made longer points past the end; one made shorter breaks the hash. */
            if (sec[off] == SEC_BIN_LEN)
                ok = rc == TS_EPROTO &&
                     (strstr(err, want[SEC_BIN_LEN]) != NULL || strstr(err, "truncated") != NULL);
            if (!ok) {
                print_error("bit %d of byte %zu (section %d): %d \"%s\"\n", bit, off, sec[off], rc,
                            err);
                fail();
            }
            seen[sec[off]]++;
            sink_reset(&s);
        }
    }
    for (int k = 0; k < SEC_COUNT; k++)
        assert_true(seen[k] > 0);
    ts__free(p);
    ts__free(sec);
    ts__free(good);
}

/* good with edit applied and every checksum made right again: the reader must say problem. */
static void expect_refused(const uint8_t *good, size_t len, size_t extra,
                           void (*edit)(uint8_t *p, size_t len), const char *problem)
{
    uint8_t *p = ts__malloc(len + extra);
    assert_non_null(p);
    memcpy(p, good, len);
    memset(p + len, 0, extra);
    edit(p, len + extra);
    snapfix_rehash(p, len + extra);
    sink_state s;
    tsd_snapfile_head head;
    char err[1024];
    int rc = read_mem(p, len + extra, &s, &head, err, sizeof(err));
    if (rc != TS_EPROTO || strstr(err, problem) == NULL) {
        print_error("want \"%s\", got %d \"%s\"\n", problem, rc, err);
        fail();
    }
    sink_reset(&s);
    ts__free(p);
}

/* Offsets in four_bins: the first bin ("params", one item), its item, the second bin. */
#define BIN0       64
#define BIN0_COUNT (BIN0 + 1 + 6 + 8)
#define BIN0_RSVD  (BIN0_COUNT + 4)
#define BIN0_LEN   (BIN0 + 17 + 6)
#define ITEM0      (BIN0_LEN + 8 + 8)

static void huge_bins(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + 24, UINT64_MAX);
}
static void huge_items(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + 32, (uint64_t)1 << 40);
}
static void huge_bin_count(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u32le(p + BIN0_COUNT, UINT32_MAX);
}
static void more_items_than_header(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + 32, 1); /* the first bin has one, the second three */
}
static void huge_item(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + BIN0_LEN, UINT64_MAX);
}
static void item_one_past_end(uint8_t *p, size_t len)
{
    ts__put_u64le(p + BIN0_LEN, len - ITEM0 + 1);
}
static void item_under_record_header(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + BIN0_LEN, TS_REC_HDR_SIZE - 1);
}
static void format_two(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u32le(p + 8, 2);
}
static void header_reserved(uint8_t *p, size_t len)
{
    (void)len;
    p[12] = 1;
}
static void bin_reserved(uint8_t *p, size_t len)
{
    (void)len;
    p[BIN0_RSVD] = 1;
}
static void wrong_bytes(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + 40, ts__get_u64le(p + 40) + 1);
}
static void trailer_bins(uint8_t *p, size_t len)
{
    ts__put_u64le(p + len - TSD_SNAP_END_SIZE + 8, 5);
}
static void not_a_record(uint8_t *p, size_t len)
{
    (void)len;
    p[ITEM0] ^= 0xFF; /* the record's magic */
}
static void nothing(uint8_t *p, size_t len)
{
    (void)p;
    (void)len;
}

static void test_lengths_and_fields_that_lie(void **state)
{
    (void)state;
    size_t len;
    uint8_t *good = seed("four_bins", &len);
    assert_memory_equal(good + BIN0 + 1, "params", 6);
    assert_int_equal(ts__get_u32le(good + BIN0_COUNT), 1);
    assert_int_equal(ts__get_u64le(good + BIN0_LEN), 76);
    expect_refused(good, len, 0, huge_bins, "more than the file can hold");
    expect_refused(good, len, 0, huge_items, "more than the file can hold");
    expect_refused(good, len, 0, huge_bin_count, "claims 4294967295 items");
    expect_refused(good, len, 0, more_items_than_header, "claims 3 items");
    expect_refused(good, len, 0, huge_item, "item 0 of bin 'params' claims");
    expect_refused(good, len, 0, item_one_past_end, "item 0 of bin 'params' claims");
    expect_refused(good, len, 0, item_under_record_header, "item 0 of bin 'params' claims 15");
    expect_refused(good, len, 0, format_two, "format 2 is not supported");
    expect_refused(good, len, 0, header_reserved, "reserved field of the file header");
    expect_refused(good, len, 0, bin_reserved, "bin 0: a reserved field");
    expect_refused(good, len, 0, wrong_bytes, "record bytes");
    expect_refused(good, len, 0, trailer_bins, "trailer does not match");
    expect_refused(good, len, 0, not_a_record, "item 0 of bin 'params' is not a valid record");
    expect_refused(good, len, 1, nothing, "1 unexpected bytes after the trailer");
    ts__free(good);
}

static void test_sink_failures(void **state)
{
    (void)state;
    size_t len;
    uint8_t *good = seed("four_bins", &len);
    char err[1024];
    for (int which = 0; which < 2; which++) {
        sink_state s;
        memset(&s, 0, sizeof(s));
        s.refuse_bin = which == 0;
        s.refuse_item = which == 1;
        tsd_snapfile_sink sink = {.arg = &s, .bin = on_bin, .item = on_item};
        tsd_snapfile_head head;
        assert_int_equal(tsd_snapfile_read_mem(good, len, LABEL, &sink, &head, err, sizeof(err)),
                         TS_ENOMEM);
        assert_non_null(strstr(err, "out of memory"));
        sink_reset(&s);
    }
    /* The writer: a descriptor that cannot be written, and its buffer not allocated. */
    sink_state s;
    tsd_snapfile_head head;
    assert_int_equal(read_mem(good, len, &s, &head, err, sizeof(err)), 0);
    int ro = open("/dev/null", O_RDONLY | O_CLOEXEC);
    assert_true(ro >= 0);
    assert_int_equal(tsd_snapfile_write(ro, &head, s.bins, item_of, &s), -EBADF);
    close(ro);
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    ts__alloc_fail_after(1);
    assert_int_equal(tsd_snapfile_write(fd, &head, s.bins, item_of, &s), -ENOMEM);
    ts__alloc_fail_after(-1);
    close(fd);
    sink_reset(&s);
    ts__free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_files_written_before_load_and_write_back),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_truncated_at_every_byte),
        cmocka_unit_test(test_flipped_byte_in_each_section),
        cmocka_unit_test(test_lengths_and_fields_that_lie),
        cmocka_unit_test(test_sink_failures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
