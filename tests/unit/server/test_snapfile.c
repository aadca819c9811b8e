/*
 * tensord's snapshot file format (server/snapfile.c), linked alone, without the loop or the
 * store: format 1 files written by tensord before streams (checked-in seeds) still load and are
 * written again byte for byte in format 1, and so does the format 2 seed with a stream that
 * tensord 0.4.0 wrote; a round trip keeps every bin and item, and in format
 * 2 every stream (settings, ids, entries, records, groups, members, orphans, pending entries),
 * written again byte for byte; a file cut short at any byte, a byte flipped anywhere, lengths,
 * counts and fields that lie (with their checksums made right), and streams that break a rule
 * (settings, dense ids, names, pending ids) are refused with a message, never read past their
 * end nor allowed to ask for more memory than the file holds.
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

#include "msg.h"
#include "proto.h"
#include "record.h"
#include "snapfile.h"
#include "snapfile_fix.h"

#define LABEL "t.snap"
/* Members of a group a file may list: TS_STREAM_MAX_MEMBERS and the group's orphans. */
#define SNAP_MAX_MEMBERS_TEST (TS_STREAM_MAX_MEMBERS + 1)
/* Bytes of the test's largest record: above half the writer's 1 MiB buffer, written directly. */
#define BIG_FLOATS (200 * 1024)

/* A stream the reader handed over, copied (its tables in the file's encoding). */
#define CAP_GROUPS  4
#define CAP_MEMBERS 4
typedef struct cap_group {
    tsd_snapfile_group g;
    uint8_t name[TS_MAX_NAME_LEN];
    tsd_snapfile_member m[CAP_MEMBERS];
    uint8_t mnames[CAP_MEMBERS][TS_MAX_NAME_LEN];
    uint8_t *pend[CAP_MEMBERS];
} cap_group;

typedef struct cap_stream {
    tsd_snapfile_stream s;
    uint8_t name[TS_MAX_NAME_LEN];
    uint8_t *entries;
    tsd_snapfile_group groups[CAP_GROUPS]; /* the writer's view of cg, once complete */
    cap_group cg[CAP_GROUPS];
    uint32_t n_groups;
} cap_stream;

/* What the reader handed over. */
typedef struct sink_state {
    tsd_snapfile_bin bins[64];
    uint8_t names[64][TS_MAX_NAME_LEN];
    size_t n_bins;
    uint8_t *items[64]; /* items of bins, then records of streams */
    size_t lens[64];
    size_t n_items;
    cap_stream streams[4];
    size_t n_streams;
    uint64_t asked; /* item and record bytes asked for */
    int refuse_bin, refuse_item, refuse_stream, refuse_record, refuse_group;
} sink_state;

static int on_bin(void *arg, const uint8_t *name, size_t name_len, uint64_t version,
                  uint32_t n_items, uint32_t flags)
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
                                            .flags = flags,
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
    if (p == NULL) /* test_streams_sink_failures fails allocations on purpose */
        return NULL;
    s->items[s->n_items] = p;
    s->lens[s->n_items++] = len;
    return p;
}

static int on_stream(void *arg, const tsd_snapfile_stream *st)
{
    sink_state *s = arg;
    if (s->refuse_stream)
        return -1;
    assert_true(s->n_streams < TS__ARRAY_SIZE(s->streams));
    assert_null(st->groups);
    size_t tl = (size_t)(st->last_id + 1 - st->first_id) * TSD_SNAP_ENTRY_SIZE;
    uint8_t *entries = ts__malloc(tl + 1);
    if (entries == NULL)
        return -1;
    cap_stream *c = &s->streams[s->n_streams++];
    memset(c, 0, sizeof(*c));
    c->s = *st;
    memcpy(c->name, st->name, st->name_len);
    c->s.name = c->name;
    c->entries = entries;
    memcpy(c->entries, st->entries, tl);
    c->s.entries = c->entries;
    c->s.first_record = s->n_items; /* its records come next */
    c->s.groups = c->groups;
    assert_true(st->n_groups <= CAP_GROUPS);
    return 0;
}

static uint8_t *on_record(void *arg, size_t len)
{
    sink_state *s = arg;
    assert_true(s->n_streams > 0);
    if (s->refuse_record)
        return NULL;
    return on_item(arg, len);
}

static int on_group(void *arg, const tsd_snapfile_group *g)
{
    sink_state *s = arg;
    if (s->refuse_group)
        return -1;
    assert_true(s->n_streams > 0);
    cap_stream *c = &s->streams[s->n_streams - 1];
    assert_true(c->n_groups < c->s.n_groups);
    assert_true(g->n_members <= CAP_MEMBERS);
    cap_group *cg = &c->cg[c->n_groups];
    cg->g = *g;
    memcpy(cg->name, g->name, g->name_len);
    cg->g.name = cg->name;
    for (uint32_t k = 0; k < g->n_members; k++) {
        cg->m[k] = g->members[k];
        if (g->members[k].name_len > 0)
            memcpy(cg->mnames[k], g->members[k].name, g->members[k].name_len);
        cg->m[k].name = cg->mnames[k];
        size_t tl = (size_t)g->members[k].n_pend * TSD_SNAP_PEND_SIZE;
        cg->pend[k] = ts__malloc(tl + 1);
        if (cg->pend[k] == NULL) {
            while (k-- > 0)
                ts__free(cg->pend[k]);
            return -1;
        }
        memcpy(cg->pend[k], g->members[k].pend, tl);
        cg->m[k].pend = cg->pend[k];
    }
    cg->g.members = cg->m;
    c->groups[c->n_groups++] = cg->g;
    return 0;
}

static void sink_reset(sink_state *s)
{
    for (size_t i = 0; i < s->n_items; i++)
        ts__free(s->items[i]);
    for (size_t k = 0; k < s->n_streams; k++) {
        ts__free(s->streams[k].entries);
        for (uint32_t g = 0; g < s->streams[k].n_groups; g++)
            for (uint32_t m = 0; m < s->streams[k].cg[g].g.n_members; m++)
                ts__free(s->streams[k].cg[g].pend[m]);
    }
    memset(s, 0, sizeof(*s));
}

/* The file's header fields, compared one by one (the struct has padding). */
static void head_equal(const tsd_snapfile_head *a, const tsd_snapfile_head *b)
{
    assert_int_equal(a->counter, b->counter);
    assert_int_equal(a->n_bins, b->n_bins);
    assert_int_equal(a->n_items, b->n_items);
    assert_int_equal(a->bytes, b->bytes);
    assert_int_equal(a->wall_ms, b->wall_ms);
    assert_int_equal(a->format, b->format);
    assert_int_equal(a->n_streams, b->n_streams);
    assert_int_equal(a->n_records, b->n_records);
    assert_int_equal(a->stream_bytes, b->stream_bytes);
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
    tsd_snapfile_sink sink = {.arg = s,
                              .bin = on_bin,
                              .item = on_item,
                              .stream = on_stream,
                              .record = on_record,
                              .group = on_group};
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
    tsd_snapfile_stream streams[4];
    for (size_t k = 0; k < s->n_streams; k++)
        streams[k] = s->streams[k].s;
    assert_int_equal(tsd_snapfile_write(fd, head, s->bins, streams, item_of, s), 0);
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
    assert_int_equal(head.format, 1);
    assert_int_equal(head.n_streams, 0);
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
    /* The same contents written now in format 1 give the same bytes: format 1 did not change. */
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
    head_equal(&h2, &head);
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
    assert_int_equal(tsd_snapfile_write(fd, &head, bins, NULL, item_of, &w), 0);
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
    /* Written in the current format, with an empty streams section. */
    assert_int_equal(got.format, TSD_SNAP_FORMAT);
    head.format = TSD_SNAP_FORMAT;
    head_equal(&got, &head);
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

/*
 * A tensor bin's flag (format 5) goes through the writer and the reader and back byte for byte;
 * the writer refuses it in format 4 and unknown bits in any format; the reader refuses the flag
 * on a record that is not a tensor bin's (a tensor of 0 dimensions).
 */
static void test_tensor_bin_flag(void **state)
{
    (void)state;
    uint64_t dims[3] = {5, 3, 2};
    uint64_t size;
    assert_int_equal(ts__rows_rec_size(TS_INT16, 3, dims, &size), 0);
    sink_state w;
    memset(&w, 0, sizeof(w));
    w.items[0] = ts__calloc(1, (size_t)size);
    assert_non_null(w.items[0]);
    size_t head_len = ts__rows_rec_head_size(3);
    ts__rows_rec_head_write(w.items[0], TS_INT16, 3, dims, size - head_len);
    w.items[0][head_len + 7] = 0x5a;
    w.lens[0] = (size_t)size;
    w.n_items = 1;
    tsd_snapfile_bin bin = {.name = (const uint8_t *)"tb",
                            .name_len = 2,
                            .version = 3,
                            .n_items = 1,
                            .flags = TSD_SNAP_BIN_TENSOR};
    tsd_snapfile_head head = {.counter = 3, .n_bins = 1, .n_items = 1, .bytes = size};
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, &head, &bin, NULL, item_of, &w), 0);
    size_t len;
    uint8_t *file = fd_bytes(fd, &len);
    close(fd);
    sink_state r;
    tsd_snapfile_head got;
    char err[1024];
    assert_int_equal(read_mem(file, len, &r, &got, err, sizeof(err)), 0);
    assert_int_equal(got.format, TSD_SNAP_FORMAT);
    assert_int_equal(r.n_bins, 1);
    assert_int_equal(r.bins[0].flags, TSD_SNAP_BIN_TENSOR);
    assert_int_equal(r.lens[0], size);
    assert_memory_equal(r.items[0], w.items[0], (size_t)size);
    fd = write_mem(&r, &got);
    size_t n;
    uint8_t *again = fd_bytes(fd, &n);
    close(fd);
    assert_int_equal(n, len);
    assert_memory_equal(again, file, len);
    ts__free(again);
    sink_reset(&r);
    ts__free(file);
    /* No flags before format 5; no unknown bits ever. */
    fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    head.format = 4;
    assert_int_equal(tsd_snapfile_write(fd, &head, &bin, NULL, item_of, &w), -EINVAL);
    head.format = 0;
    bin.flags = 0x4;
    assert_int_equal(tsd_snapfile_write(fd, &head, &bin, NULL, item_of, &w), -EINVAL);
    close(fd);
    sink_reset(&w);
    /* A tensor of 0 dimensions is a valid record but not a tensor bin's. */
    size_t rl;
    ts_value_t *scalar = ts_tensor_alloc(TS_FLOAT32, 0, NULL);
    assert_non_null(scalar);
    uint8_t *rec;
    assert_int_equal(ts__record_encode(scalar, &rec, &rl), 0);
    ts_value_free(scalar);
    w.items[0] = ts__malloc(rl);
    assert_non_null(w.items[0]);
    memcpy(w.items[0], rec, rl);
    ts__free_aligned(rec, rl);
    w.lens[0] = rl;
    w.n_items = 1;
    bin.flags = TSD_SNAP_BIN_TENSOR;
    head.bytes = rl;
    fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, &head, &bin, NULL, item_of, &w), 0);
    file = fd_bytes(fd, &len);
    close(fd);
    assert_int_equal(read_mem(file, len, &r, &got, err, sizeof(err)), TS_EPROTO);
    assert_non_null(strstr(err, "bin 'tb' is marked a tensor bin but its record is not"));
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
static void format_next(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u32le(p + 8, TSD_SNAP_FORMAT + 1);
}
static void format_zero(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u32le(p + 8, 0);
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
    expect_refused(good, len, 0, format_next, "format 6 is not supported");
    expect_refused(good, len, 0, format_zero, "format 0 is not supported");
    expect_refused(good, len, 0, header_reserved, "reserved field of the file header");
    expect_refused(good, len, 0, bin_reserved, "bin 'params': a reserved field");
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
    assert_int_equal(tsd_snapfile_write(ro, &head, s.bins, NULL, item_of, &s), -EBADF);
    close(ro);
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    ts__alloc_fail_after(1);
    assert_int_equal(tsd_snapfile_write(fd, &head, s.bins, NULL, item_of, &s), -ENOMEM);
    ts__alloc_fail_after(-1);
    close(fd);
    sink_reset(&s);
    ts__free(good);
}

/* ---------------------------------------------------------------------------------------------
 * Streams (format 2)
 */

/*
 * A snapshot with one bin and two streams, built as tensord's snapshot job builds one:
 * "events" keeps ids 5..9 (records 5, 7, 8; markers 6 and 9), a group "fan-a" with a member
 * holding two pending entries (one partly done), its orphans holding one, an idle member, and a
 * group "fan-b" with no member at first_id; "trimmed" kept none of its 100 entries and has a
 * group of one member with nothing pending. Edits then break one rule at a time.
 */
typedef struct fixture {
    sink_state w; /* items: the three records of "events", then the bin's item */
    uint8_t entries[5 * TSD_SNAP_ENTRY_SIZE];
    uint8_t pend_m1[2 * TSD_SNAP_PEND_SIZE], pend_orph[TSD_SNAP_PEND_SIZE];
    tsd_snapfile_member ma[3], mt[1];
    tsd_snapfile_group ga[2], gt[1];
    tsd_snapfile_stream st[2];
    tsd_snapfile_head head;
} fixture;

static void fixture_init(fixture *f)
{
    memset(f, 0, sizeof(*f));
    for (size_t i = 0; i < 4; i++) {
        size_t len;
        uint8_t *r = record((int64_t)(3 + 5 * i), 1.5f + (float)i, &len);
        f->w.items[i] = ts__malloc(len);
        assert_non_null(f->w.items[i]);
        memcpy(f->w.items[i], r, len);
        f->w.lens[i] = len;
        ts__free_aligned(r, len);
    }
    f->w.n_items = 4;
    f->w.bins[0] = (tsd_snapfile_bin){
        .name = (const uint8_t *)"bin", .name_len = 3, .version = 3, .first = 3, .n_items = 1};
    f->w.n_bins = 1;
    tsd_snapfile_entry_put(f->entries, 0, f->w.lens[0], 0, 900);
    tsd_snapfile_entry_put(f->entries, 1, 0, 7, 800);
    tsd_snapfile_entry_put(f->entries, 2, f->w.lens[1], 0, 700);
    tsd_snapfile_entry_put(f->entries, 3, f->w.lens[2], 0, 600);
    tsd_snapfile_entry_put(f->entries, 4, 0, UINT64_MAX, 0);
    tsd_snapfile_pend_put(f->pend_m1, 0, 7, 2, 3);
    tsd_snapfile_pend_put(f->pend_m1, 1, 9, 1, 0);
    tsd_snapfile_pend_put(f->pend_orph, 0, 8, 1, 0);
    f->ma[0] = (tsd_snapfile_member){
        .name = (const uint8_t *)"m1", .name_len = 2, .pend = f->pend_m1, .n_pend = 2};
    f->ma[1] = (tsd_snapfile_member){.pend = f->pend_orph, .n_pend = 1}; /* the orphans */
    f->ma[2] = (tsd_snapfile_member){.name = (const uint8_t *)"m2", .name_len = 2};
    f->ga[0] = (tsd_snapfile_group){.name = (const uint8_t *)"fan-a",
                                    .name_len = 5,
                                    .next_id = 10,
                                    .lost = 4,
                                    .lease_ms = 5000,
                                    .members = f->ma,
                                    .n_members = 3};
    f->ga[1] = (tsd_snapfile_group){
        .name = (const uint8_t *)"fan-b", .name_len = 5, .next_id = 5, .lease_ms = 20000};
    f->st[0] = (tsd_snapfile_stream){.name = (const uint8_t *)"events",
                                     .name_len = 6,
                                     .max_entries = 100,
                                     .max_bytes = 1 << 20,
                                     .max_age_ms = 60000,
                                     .window = 50,
                                     .lease_ms = 5000,
                                     .first_id = 5,
                                     .last_id = 9,
                                     .entries = f->entries,
                                     .first_record = 0,
                                     .groups = f->ga,
                                     .n_groups = 2};
    f->mt[0] = (tsd_snapfile_member){.name = (const uint8_t *)"x", .name_len = 1};
    f->gt[0] = (tsd_snapfile_group){.name = (const uint8_t *)"g",
                                    .name_len = 1,
                                    .next_id = 101,
                                    .lost = 7,
                                    .lease_ms = 10000,
                                    .members = f->mt,
                                    .n_members = 1};
    f->st[1] = (tsd_snapfile_stream){.name = (const uint8_t *)"trimmed",
                                     .name_len = 7,
                                     .max_entries = 10,
                                     .lease_ms = 10000,
                                     .first_id = 101,
                                     .last_id = 100,
                                     .groups = f->gt,
                                     .n_groups = 1};
    f->head = (tsd_snapfile_head){.counter = 77,
                                  .n_bins = 1,
                                  .n_items = 1,
                                  .bytes = f->w.lens[3],
                                  .wall_ms = 5,
                                  .n_streams = 2,
                                  .n_records = 3,
                                  .stream_bytes = f->w.lens[0] + f->w.lens[1] + f->w.lens[2]};
}

/* The fixture's file, into a new buffer. */
static uint8_t *fixture_file(fixture *f, size_t *len)
{
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, &f->head, f->w.bins, f->st, item_of, &f->w), 0);
    uint8_t *b = fd_bytes(fd, len);
    close(fd);
    return b;
}

static void test_streams_round_trip(void **state)
{
    (void)state;
    fixture f;
    fixture_init(&f);
    size_t len;
    uint8_t *file = fixture_file(&f, &len);
    sink_state r;
    tsd_snapfile_head got;
    char err[1024];
    int rc = read_mem(file, len, &r, &got, err, sizeof(err));
    if (rc != 0)
        print_error("%s\n", err);
    assert_int_equal(rc, 0);
    f.head.format = TSD_SNAP_FORMAT;
    head_equal(&got, &f.head);
    assert_int_equal(r.n_bins, 1);
    assert_int_equal(r.n_streams, 2);
    /* The bin's item first, then the stream's records in id order. */
    assert_int_equal(r.n_items, 4);
    assert_memory_equal(r.items[0], f.w.items[3], f.w.lens[3]);
    for (size_t i = 0; i < 3; i++) {
        assert_int_equal(r.lens[1 + i], f.w.lens[i]);
        assert_memory_equal(r.items[1 + i], f.w.items[i], f.w.lens[i]);
    }
    for (size_t k = 0; k < 2; k++) {
        const tsd_snapfile_stream *a = &f.st[k], *b = &r.streams[k].s;
        assert_int_equal(b->name_len, a->name_len);
        assert_memory_equal(b->name, a->name, a->name_len);
        assert_int_equal(b->max_entries, a->max_entries);
        assert_int_equal(b->max_bytes, a->max_bytes);
        assert_int_equal(b->max_age_ms, a->max_age_ms);
        assert_int_equal(b->window, a->window);
        assert_int_equal(b->lease_ms, a->lease_ms);
        assert_int_equal(b->first_id, a->first_id);
        assert_int_equal(b->last_id, a->last_id);
        assert_int_equal(b->n_records, k == 0 ? 3 : 0);
        assert_memory_equal(b->entries, k == 0 ? f.entries : (const uint8_t *)"",
                            (size_t)(a->last_id + 1 - a->first_id) * TSD_SNAP_ENTRY_SIZE);
        assert_int_equal(r.streams[k].n_groups, a->n_groups);
        for (uint32_t g = 0; g < a->n_groups; g++) {
            const tsd_snapfile_group *ga = &a->groups[g], *gb = &r.streams[k].groups[g];
            assert_int_equal(gb->name_len, ga->name_len);
            assert_memory_equal(gb->name, ga->name, ga->name_len);
            assert_int_equal(gb->next_id, ga->next_id);
            assert_int_equal(gb->lost, ga->lost);
            assert_int_equal(gb->lease_ms, ga->lease_ms);
            assert_int_equal(gb->n_members, ga->n_members);
            for (uint32_t m = 0; m < ga->n_members; m++) {
                const tsd_snapfile_member *ma = &ga->members[m], *mb = &gb->members[m];
                assert_int_equal(mb->name_len, ma->name_len);
                assert_memory_equal(mb->name, ma->name, ma->name_len);
                assert_int_equal(mb->n_pend, ma->n_pend);
                assert_memory_equal(mb->pend, ma->pend, (size_t)ma->n_pend * TSD_SNAP_PEND_SIZE);
            }
        }
    }
    uint64_t id;
    uint32_t deliveries, rows;
    tsd_snapfile_pend_get(r.streams[0].groups[0].members[0].pend, 0, &id, &deliveries, &rows);
    assert_int_equal(id, 7);
    assert_int_equal(deliveries, 2);
    assert_int_equal(rows, 3);
    /* Written again from what was read: the same bytes (one encoding per snapshot). */
    int fd = write_mem(&r, &got);
    size_t n;
    uint8_t *again = fd_bytes(fd, &n);
    close(fd);
    assert_int_equal(n, len);
    assert_memory_equal(again, file, len);
    ts__free(again);
    /* A file of streams is not format 1, and a reader without the stream functions refuses it. */
    tsd_snapfile_head h1 = f.head;
    h1.format = 1;
    fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    assert_int_equal(tsd_snapfile_write(fd, &h1, f.w.bins, f.st, item_of, &f.w), -EINVAL);
    close(fd);
    sink_state s2;
    memset(&s2, 0, sizeof(s2));
    tsd_snapfile_sink old = {.arg = &s2, .bin = on_bin, .item = on_item};
    assert_int_equal(tsd_snapfile_read_mem(file, len, LABEL, &old, &got, err, sizeof(err)),
                     TS_EINVAL);
    assert_non_null(strstr(err, "holds streams"));
    sink_reset(&s2);
    sink_reset(&r);
    sink_reset(&f.w);
    ts__free(file);
}

static void test_streams_truncated_and_flipped(void **state)
{
    (void)state;
    fixture f;
    fixture_init(&f);
    size_t len;
    uint8_t *good = fixture_file(&f, &len);
    char err[1024];
    for (size_t cut = 0; cut < len; cut++) {
        uint8_t *p = ts__malloc(cut + 1);
        assert_non_null(p);
        memcpy(p, good, cut);
        sink_state s;
        tsd_snapfile_head head;
        int rc = read_mem(p, cut, &s, &head, err, sizeof(err));
        if (rc != TS_EPROTO || strstr(err, "truncated") == NULL) {
            print_error("cut at %zu of %zu: %d \"%s\"\n", cut, len, rc, err);
            fail();
        }
        sink_reset(&s);
        ts__free(p);
    }
    /* Every byte is under a checksum: a flipped bit anywhere is refused. */
    uint8_t *p = ts__malloc(len);
    assert_non_null(p);
    for (size_t off = 0; off < len; off++) {
        for (int bit = 0; bit < 8; bit += 3) {
            memcpy(p, good, len);
            p[off] ^= (uint8_t)(1u << bit);
            sink_state s;
            tsd_snapfile_head head;
            int rc = read_mem(p, len, &s, &head, err, sizeof(err));
            if (rc != TS_EPROTO) {
                print_error("bit %d of byte %zu: %d \"%s\"\n", bit, off, rc, err);
                fail();
            }
            sink_reset(&s);
        }
    }
    ts__free(p);
    ts__free(good);
    sink_reset(&f.w);
}

/*
 * The seed tensord 0.4.0 wrote (test_stream_snapshot): stream "q" with markers 1..4 and a record
 * 5, group "grp" with m1 holding 1 and 2, m2 holding 3 and 4 (2 rows of 4 done), and 5 orphaned
 * by m3, which left. It reads as that, and writes back byte for byte: format 2 did not change.
 */
static void test_streams_seed(void **state)
{
    (void)state;
    size_t len;
    uint8_t *good = seed("streams", &len);
    sink_state s;
    tsd_snapfile_head head;
    char err[1024];
    int rc = read_mem(good, len, &s, &head, err, sizeof(err));
    if (rc != 0)
        print_error("%s\n", err);
    assert_int_equal(rc, 0);
    assert_int_equal(head.format, 2);
    assert_int_equal(head.n_bins, 0);
    assert_int_equal(head.n_streams, 1);
    assert_int_equal(head.n_records, 1);
    const tsd_snapfile_stream *st = &s.streams[0].s;
    assert_int_equal(st->name_len, 1);
    assert_int_equal(st->name[0], 'q');
    assert_int_equal(st->first_id, 1);
    assert_int_equal(st->last_id, 5);
    assert_int_equal(st->max_entries, 10);
    assert_int_equal(st->lease_ms, 10000);
    for (size_t k = 0; k < 5; k++) {
        uint64_t rl, tag, age;
        tsd_snapfile_entry_get(st->entries, k, &rl, &tag, &age);
        assert_int_equal(rl == 0, k < 4);
        assert_int_equal(tag, k < 4 ? k : 0);
    }
    assert_int_equal(s.streams[0].n_groups, 1);
    const tsd_snapfile_group *g = &s.streams[0].groups[0];
    assert_memory_equal(g->name, "grp", 3);
    assert_int_equal(g->next_id, 6);
    assert_int_equal(g->n_members, 3);
    static const char *const names[] = {"m1", "m2", ""};
    static const uint64_t first[] = {1, 3, 5};
    static const uint32_t n_pend[] = {2, 2, 1};
    for (uint32_t m = 0; m < 3; m++) {
        assert_int_equal(g->members[m].name_len, strlen(names[m]));
        assert_memory_equal(g->members[m].name, names[m], strlen(names[m]));
        assert_int_equal(g->members[m].n_pend, n_pend[m]);
        uint64_t id;
        uint32_t d, rows;
        tsd_snapfile_pend_get(g->members[m].pend, 0, &id, &d, &rows);
        assert_int_equal(id, first[m]);
        assert_int_equal(d, 1);
    }
    uint64_t id;
    uint32_t d, rows;
    tsd_snapfile_pend_get(g->members[1].pend, 1, &id, &d, &rows);
    assert_int_equal(id, 4);
    assert_int_equal(rows, 2);
    int fd = write_mem(&s, &head);
    size_t n;
    uint8_t *again = fd_bytes(fd, &n);
    close(fd);
    assert_int_equal(n, len);
    assert_memory_equal(again, good, len);
    ts__free(again);
    sink_reset(&s);
    ts__free(good);
}

/* The fixture with edit applied, written (checksums right): the reader must say problem. */
static void expect_stream_refused(void (*edit)(fixture *f), const char *problem)
{
    fixture f;
    fixture_init(&f);
    edit(&f);
    size_t len;
    uint8_t *file = fixture_file(&f, &len);
    sink_state s;
    tsd_snapfile_head head;
    char err[1024];
    int rc = read_mem(file, len, &s, &head, err, sizeof(err));
    if (rc != TS_EPROTO || strstr(err, problem) == NULL) {
        print_error("want \"%s\", got %d \"%s\"\n", problem, rc, err);
        fail();
    }
    sink_reset(&s);
    sink_reset(&f.w);
    ts__free(file);
}

static void e_stream_empty_name(fixture *f)
{
    f->st[0].name_len = 0;
}
static void e_max_entries_zero(fixture *f)
{
    f->st[1].max_entries = 0;
}
static void e_max_entries_huge(fixture *f)
{
    f->st[1].max_entries = TS_STREAM_MAX_ENTRIES + 1;
}
static void e_window_over(fixture *f)
{
    f->st[1].window = 11;
}
static void e_lease_zero(fixture *f)
{
    f->st[1].lease_ms = 0;
}
static void e_lease_long(fixture *f)
{
    f->st[1].lease_ms = TS_STREAM_MAX_LEASE_MS + 1;
}
static void e_first_id_zero(fixture *f)
{
    f->st[1].first_id = 0;
    f->st[1].last_id = UINT64_MAX; /* still no entry: last_id + 1 == first_id in 64 bits */
}
static void e_record_with_tag(fixture *f)
{
    tsd_snapfile_entry_put(f->entries, 2, f->w.lens[1], 1, 700);
}
static void e_record_short(fixture *f)
{
    /* A marker turned into a 5-byte record: shorter than a record header. */
    tsd_snapfile_entry_put(f->entries, 1, 5, 0, 800);
}
static void e_group_empty_name(fixture *f)
{
    f->ga[1].name_len = 0;
}
static void e_group_twice(fixture *f)
{
    f->ga[1].name = (const uint8_t *)"fan-a";
}
static void e_next_id_low(fixture *f)
{
    f->ga[1].next_id = 4;
}
static void e_next_id_high(fixture *f)
{
    f->gt[0].next_id = 102;
}
static void e_group_lease(fixture *f)
{
    f->ga[1].lease_ms = 0;
}
static void e_member_twice(fixture *f)
{
    f->ma[2].name = (const uint8_t *)"m1";
}
static void e_orphans_twice(fixture *f)
{
    f->ma[2].name_len = 0;
}
static void e_pending_below(fixture *f)
{
    tsd_snapfile_pend_put(f->pend_orph, 0, 4, 1, 0);
}
static void e_pending_not_handed(fixture *f)
{
    f->ga[0].next_id = 9; /* the member holds 9 */
}
static void e_pending_unsorted(fixture *f)
{
    tsd_snapfile_pend_put(f->pend_m1, 0, 9, 2, 3);
    tsd_snapfile_pend_put(f->pend_m1, 1, 7, 1, 0);
}
static void e_pending_same_twice(fixture *f)
{
    tsd_snapfile_pend_put(f->pend_m1, 1, 7, 1, 0);
}
static void e_pending_in_two(fixture *f)
{
    tsd_snapfile_pend_put(f->pend_orph, 0, 9, 1, 0);
}
static void e_pending_more_than_ids(fixture *f)
{
    /* fan-b at first_id handed nothing out: a member of it cannot hold anything. */
    f->ga[1].members = f->ma;
    f->ga[1].n_members = 1;
}
static void e_section_records(fixture *f)
{
    f->head.n_records = 4;
}
static void e_section_records_low(fixture *f)
{
    f->head.n_records = 2;
}
static void e_section_bytes(fixture *f)
{
    f->head.stream_bytes++;
}

static void test_streams_rules(void **state)
{
    (void)state;
    expect_stream_refused(e_stream_empty_name, "stream 0 has an empty name");
    expect_stream_refused(e_max_entries_zero, "stream 'trimmed': a setting is out of range");
    expect_stream_refused(e_max_entries_huge, "a setting is out of range (max_entries 16777217");
    expect_stream_refused(e_window_over, "window 11");
    expect_stream_refused(e_lease_zero, "lease_ms 0");
    expect_stream_refused(e_lease_long, "lease_ms 86400001");
    expect_stream_refused(e_first_id_zero, "first_id 0 and last_id 18446744073709551615");
    expect_stream_refused(e_record_with_tag, "entry 7 of stream 'events' is a record with a tag");
    expect_stream_refused(e_record_short, "entry 6 of stream 'events' claims 5 bytes");
    expect_stream_refused(e_group_empty_name, "group 1 of stream 'events' has an empty name");
    expect_stream_refused(e_group_twice, "group 'fan-a' appears twice in stream 'events'");
    expect_stream_refused(e_next_id_low, "group 'fan-b' of stream 'events': next_id 4 is outside");
    expect_stream_refused(e_next_id_high, "next_id 102 is outside [101, 101]");
    expect_stream_refused(e_group_lease, "group 'fan-b' of stream 'events': lease_ms 0");
    expect_stream_refused(e_member_twice, "member 'm1' appears twice in group 'fan-a'");
    expect_stream_refused(e_orphans_twice, "group 'fan-a' of stream 'events' lists its orphaned");
    expect_stream_refused(e_pending_below, "member 1 of group 'fan-a' of stream 'events': pending "
                                           "id 4");
    expect_stream_refused(e_pending_not_handed, "pending id 9 is not above");
    expect_stream_refused(e_pending_unsorted, "pending id 7 is not above the one before it");
    expect_stream_refused(e_pending_same_twice, "pending id 7 is not above the one before it");
    expect_stream_refused(e_pending_in_two, "group 'fan-a' of stream 'events': entry 9 is pending "
                                            "twice");
    expect_stream_refused(e_pending_more_than_ids, "has 2 pending entries, more than the 0 ids");
    expect_stream_refused(e_section_records, "claims 4 records");
    expect_stream_refused(e_section_records_low, "more records than the streams section claims");
    expect_stream_refused(e_section_bytes, "the streams section claims 3 records");
}

/* Offsets in the fixture's file, found from its layout. */
static size_t fixture_sec(fixture *f)
{
    /* Header, the bin's header (3-byte name, one length) and hash, its item and hash. */
    return TSD_SNAP_HDR_SIZE + 17 + 3 + 8 + 8 + f->w.lens[3] + 8;
}

static size_t g_off; /* where the edits below write */
static uint64_t g_val;
static void put64(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u64le(p + g_off, g_val);
}
static void put32(uint8_t *p, size_t len)
{
    (void)len;
    ts__put_u32le(p + g_off, (uint32_t)g_val);
}

/* Counts and fields the writer would never write, edited in and rehashed. */
static void test_streams_counts_that_lie(void **state)
{
    (void)state;
    fixture f;
    fixture_init(&f);
    size_t len;
    uint8_t *good = fixture_file(&f, &len);
    size_t sec = fixture_sec(&f);
    assert_memory_equal(good + sec, "TSDSTRM", 8);
    size_t st0 = sec + TSD_SNAP_SEC_SIZE, q0 = st0 + 1 + 6;
    assert_memory_equal(good + st0 + 1, "events", 6);
    /* The entry table of "events" follows its header; its groups follow its records. */
    size_t recs = q0 + 48 + 8 + 5 * TSD_SNAP_ENTRY_SIZE + 8;
    size_t ga0 = recs + f.w.lens[0] + f.w.lens[1] + f.w.lens[2] + 3 * 8;
    assert_memory_equal(good + ga0 + 1, "fan-a", 5);
    size_t m0 = ga0 + 25 + 5 + 8;
    assert_memory_equal(good + m0 + 1, "m1", 2);

    g_off = sec;
    g_val = 0;
    expect_refused(good, len, 0, put64, "the streams section is missing");
    g_off = sec + 8;
    g_val = UINT64_MAX;
    expect_refused(good, len, 0, put64, "the streams section claims 18446744073709551615 streams");
    g_off = sec + 16;
    g_val = (uint64_t)1 << 40;
    expect_refused(good, len, 0, put64, "more than the file can hold");
    g_off = sec + 8;
    g_val = 3;
    expect_refused(good, len, 0, put64, "the header of stream 2");
    /* last_id far ahead: 2^24 + 1 entries, then as many as the file cannot hold. */
    g_off = q0 + 40;
    g_val = 5 + TS_STREAM_MAX_ENTRIES;
    expect_refused(good, len, 0, put64, "stream 'events' keeps 16777217 entries");
    g_val = 5 + 100000;
    expect_refused(good, len, 0, put64, "stream 'events' claims 100001 entries");
    g_off = q0 + 28;
    g_val = 1000;
    expect_refused(good, len, 0, put32, "stream 'events' claims 1000 groups");
    const uint8_t *tr = memmem(good, len, "\x07trimmed", 8);
    assert_non_null(tr);
    g_off = (size_t)(tr - good) + 8 + 28;
    g_val = TS_STREAM_MAX_GROUPS + 1;
    expect_refused(good, len, 0, put32, "stream 'trimmed' has 1025 groups");
    /* A record length past the end, and one that overflows. */
    g_off = q0 + 48 + 8;
    g_val = len;
    expect_refused(good, len, 0, put64, "entry 5 of stream 'events' claims");
    g_val = UINT64_MAX;
    expect_refused(good, len, 0, put64, "entry 5 of stream 'events' claims");
    /* A record that is not one. */
    g_off = recs;
    g_val = 0;
    expect_refused(good, len, 0, put64, "entry 5 of stream 'events' is not a valid record");
    /* Members and pending entries claimed past the end. */
    g_off = ga0 + 1 + 5 + 20;
    g_val = SNAP_MAX_MEMBERS_TEST + 1;
    expect_refused(good, len, 0, put32, "has 1026 members, more than 1025");
    g_val = 1000;
    expect_refused(good, len, 0, put32, "group 'fan-a' of stream 'events' claims 1000 members");
    /* Ids that go backwards (first_id above last_id + 1). */
    g_off = q0 + 32;
    g_val = 11;
    expect_refused(good, len, 0, put64, "first_id 11 and last_id 9 break the id rules");
    g_off = m0 + 1 + 2;
    g_val = 6;
    expect_refused(good, len, 0, put32,
                   "member 0 of group 'fan-a' of stream 'events' has 6 pending entries, more than "
                   "the 5 ids");
    g_val = 3; /* the third row is what follows the table: no id in order */
    expect_refused(good, len, 0, put32, "is not above the one before it");
    g_off = m0 + 1 + 2 + 4;
    g_val = 1;
    expect_refused(good, len, 0, put32, "member 0 of group 'fan-a' of stream 'events': a reserved");
    ts__free(good);
    sink_reset(&f.w);
}

static void test_streams_sink_failures(void **state)
{
    (void)state;
    fixture f;
    fixture_init(&f);
    size_t len;
    uint8_t *file = fixture_file(&f, &len);
    char err[1024];
    for (int which = 0; which < 3; which++) {
        sink_state s;
        memset(&s, 0, sizeof(s));
        s.refuse_stream = which == 0;
        s.refuse_record = which == 1;
        s.refuse_group = which == 2;
        tsd_snapfile_sink sink = {.arg = &s,
                                  .bin = on_bin,
                                  .item = on_item,
                                  .stream = on_stream,
                                  .record = on_record,
                                  .group = on_group};
        tsd_snapfile_head head;
        assert_int_equal(tsd_snapfile_read_mem(file, len, LABEL, &sink, &head, err, sizeof(err)),
                         TS_ENOMEM);
        assert_non_null(strstr(err, "out of memory"));
        sink_reset(&s);
    }
    /* The reader's own buffers: every allocation it makes may fail. */
    for (int n = 1; n < 64; n++) {
        sink_state s;
        tsd_snapfile_head head;
        ts__alloc_fail_after(n);
        int rc = read_mem(file, len, &s, &head, err, sizeof(err));
        ts__alloc_fail_after(-1);
        sink_reset(&s);
        if (rc == 0)
            break;
        assert_int_equal(rc, TS_ENOMEM);
    }
    ts__free(file);
    sink_reset(&f.w);
}

/* ---------------------------------------------------------------------------------------------
 * The parameter server (format 4)
 */

/* What the reader handed over of the parameter server section. */
typedef struct ps_sink {
    tsd_snapfile_param params[4];
    uint8_t pnames[4][TS_MAX_NAME_LEN];
    uint8_t rings[4][4 * TSD_SNAP_RING_SIZE];
    size_t n_params;
    tsd_snapfile_emb embs[4];
    uint8_t enames[4][TS_MAX_NAME_LEN];
    size_t n_embs;
    void *arrays[32]; /* in the order asked for */
    size_t lens[32];
    size_t n_arrays;
    uint64_t asked;
} ps_sink;

static int on_param(void *arg, const tsd_snapfile_param *p)
{
    ps_sink *s = arg;
    assert_true(s->n_params < 4 && p->ring_n <= 4);
    size_t k = s->n_params++;
    s->params[k] = *p;
    memcpy(s->pnames[k], p->name, p->name_len);
    memcpy(s->rings[k], p->ring, (size_t)p->ring_n * TSD_SNAP_RING_SIZE);
    s->params[k].name = s->pnames[k];
    s->params[k].ring = s->rings[k];
    return 0;
}

static int on_emb(void *arg, const tsd_snapfile_emb *t)
{
    ps_sink *s = arg;
    assert_true(s->n_embs < 4);
    size_t k = s->n_embs++;
    s->embs[k] = *t;
    memcpy(s->enames[k], t->name, t->name_len);
    s->embs[k].name = s->enames[k];
    return 0;
}

static void *on_ps_array(void *arg, size_t len)
{
    ps_sink *s = arg;
    assert_true(s->n_arrays < 32);
    s->asked += len;
    s->lens[s->n_arrays] = len;
    return s->arrays[s->n_arrays++] = ts__malloc(len ? len : 1);
}

static void ps_sink_free(ps_sink *s)
{
    for (size_t k = 0; k < s->n_arrays; k++)
        ts__free(s->arrays[k]);
    s->n_arrays = 0;
}

static int ps_read(const uint8_t *p, size_t len, ps_sink *s, tsd_snapfile_head *head, char *err,
                   size_t cap)
{
    memset(s, 0, sizeof(*s));
    tsd_snapfile_sink sink = {.arg = s, .param = on_param, .emb = on_emb, .ps_array = on_ps_array};
    err[0] = '\0';
    int rc = tsd_snapfile_read_mem(p, len, LABEL, &sink, head, err, cap);
    assert_true(s->asked <= len);
    return rc;
}

/* Two parameters and two tables (one empty), written without bins. */
static const float ps_m[5] = {0.5f, -1, 2, 0, 3}, ps_v[5] = {1, 2, 3, 4, 5};
static const int64_t ps_ids[3] = {7, 0, 1ll << 40};
static const float ps_rows[3 * 6] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18};
static const uint32_t ps_steps[3] = {1, 5, 2};

static uint8_t *ps_file(size_t *len, uint32_t format, int *wrc)
{
    uint8_t ring1[TSD_SNAP_RING_SIZE], ring2[3 * TSD_SNAP_RING_SIZE];
    ts__put_u64le(ring1, 9);
    ts__put_u64le(ring1 + 8, 0);
    for (int i = 0; i < 3; i++) {
        ts__put_u64le(ring2 + i * TSD_SNAP_RING_SIZE, 10 + (uint64_t)i);
        ts__put_u64le(ring2 + i * TSD_SNAP_RING_SIZE + 8, (uint64_t)i * 2);
    }
    tsd_snapfile_param params[2] = {{.name = (const uint8_t *)"w",
                                     .name_len = 1,
                                     .opt = TS_PS_OPT_ADAM,
                                     .k = 1,
                                     .lr = 0.1,
                                     .beta1 = 0.9,
                                     .beta2 = 0.999,
                                     .eps = 1e-8,
                                     .numel = 5,
                                     .adam_t = 3,
                                     .steps = 3,
                                     .bin_version = 12,
                                     .ring_n = 1,
                                     .ring = ring1,
                                     .slot = {ps_m, ps_v}},
                                    {.name = (const uint8_t *)"s",
                                     .name_len = 1,
                                     .opt = TS_PS_OPT_SUM,
                                     .mode = TS_PS_MODE_SYNC,
                                     .k = 4,
                                     .tolerance = 2,
                                     .numel = 3,
                                     .steps = 4,
                                     .bin_version = 12,
                                     .ring_n = 3,
                                     .ring = ring2}};
    tsd_snapfile_emb embs[2] = {{.name = (const uint8_t *)"emb",
                                 .name_len = 3,
                                 .dim = 2,
                                 .opt = TS_PS_OPT_ADAM,
                                 .init = TS_PSW_INIT_NORMAL,
                                 .seed = 4,
                                 .lr = 0.01,
                                 .beta1 = 0.9,
                                 .beta2 = 0.99,
                                 .eps = 1e-6,
                                 .init_scale = 1,
                                 .version = 8,
                                 .n_rows = 3,
                                 .ids = ps_ids,
                                 .rows = ps_rows,
                                 .steps = ps_steps},
                                {.name = (const uint8_t *)"e0",
                                 .name_len = 2,
                                 .dim = 1,
                                 .opt = TS_PS_OPT_SGD,
                                 .num_ids = 10,
                                 .version = 3}};
    tsd_snapfile_ps ps = {.params = params, .n_params = 2, .embs = embs, .n_embs = 2};
    tsd_snapfile_head head = {.counter = 12, .format = format};
    int fd = memfd_create("test_snapfile", MFD_CLOEXEC);
    assert_true(fd >= 0);
    *wrc = tsd_snapfile_write_ps(fd, &head, NULL, NULL, NULL, &ps, item_of, NULL);
    uint8_t *b = fd_bytes(fd, len);
    close(fd);
    return b;
}

static void test_ps_round_trip(void **state)
{
    (void)state;
    size_t len;
    int wrc;
    uint8_t *old = ps_file(&len, 3, &wrc);
    assert_int_equal(wrc, -EINVAL); /* format 3 has no room for it */
    ts__free(old);
    uint8_t *good = ps_file(&len, 0, &wrc);
    assert_int_equal(wrc, 0);
    assert_int_equal(ts__get_u32le(good + 8), TSD_SNAP_FORMAT);
    ps_sink s;
    tsd_snapfile_head head;
    char err[1024];
    assert_int_equal(ps_read(good, len, &s, &head, err, sizeof(err)), 0);
    assert_int_equal(head.n_params, 2);
    assert_int_equal(head.n_embs, 2);
    assert_int_equal(head.n_rows, 3);
    assert_int_equal(s.n_params, 2);
    assert_int_equal(s.n_embs, 2);
    const tsd_snapfile_param *w = &s.params[0], *sp = &s.params[1];
    assert_true(w->opt == TS_PS_OPT_ADAM && w->numel == 5 && w->adam_t == 3 && w->lr == 0.1 &&
                w->beta2 == 0.999 && w->bin_version == 12 && w->ring_n == 1);
    assert_true(sp->mode == TS_PS_MODE_SYNC && sp->k == 4 && sp->tolerance == 2 &&
                sp->ring_n == 3 && ts__get_u64le(sp->ring + 2 * TSD_SNAP_RING_SIZE) == 12);
    const tsd_snapfile_emb *e = &s.embs[0];
    assert_true(e->dim == 2 && e->seed == 4 && e->n_rows == 3 && e->version == 8 &&
                e->init == TS_PSW_INIT_NORMAL && e->eps == 1e-6);
    assert_true(s.embs[1].n_rows == 0 && s.embs[1].num_ids == 10);
    /* Arrays in file order: w's m and v, emb's ids, rows, steps, e0's ids and rows. */
    assert_int_equal(s.n_arrays, 7);
    assert_memory_equal(s.arrays[0], ps_m, sizeof(ps_m));
    assert_memory_equal(s.arrays[1], ps_v, sizeof(ps_v));
    assert_memory_equal(s.arrays[2], ps_ids, sizeof(ps_ids));
    assert_memory_equal(s.arrays[3], ps_rows, sizeof(ps_rows));
    assert_memory_equal(s.arrays[4], ps_steps, sizeof(ps_steps));
    assert_true(s.lens[5] == 0 && s.lens[6] == 0);
    ps_sink_free(&s);
    /* A reader without the parameter server's functions refuses the file. */
    tsd_snapfile_sink none = {.arg = &s};
    assert_int_equal(tsd_snapfile_read_mem(good, len, LABEL, &none, &head, err, sizeof(err)),
                     TS_EINVAL);
    assert_non_null(strstr(err, "parameter server state"));
    /* Cut at every byte, or any byte flipped: refused, never read past the end. */
    for (size_t cut = 0; cut < len; cut++) {
        uint8_t *p = ts__malloc(cut + 1);
        assert_non_null(p);
        memcpy(p, good, cut);
        int rc = ps_read(p, cut, &s, &head, err, sizeof(err));
        ps_sink_free(&s);
        if (rc != TS_EPROTO || strstr(err, "truncated") == NULL) {
            print_error("cut at %zu: %d \"%s\"\n", cut, rc, err);
            fail();
        }
        ts__free(p);
    }
    uint8_t *bad = ts__malloc(len);
    assert_non_null(bad);
    for (size_t i = 0; i < len; i++) {
        memcpy(bad, good, len);
        bad[i] ^= 0x10;
        int rc = ps_read(bad, len, &s, &head, err, sizeof(err));
        ps_sink_free(&s);
        if (rc != TS_EPROTO) {
            print_error("byte %zu flipped: %d \"%s\"\n", i, rc, err);
            fail();
        }
    }
    ts__free(bad);
    ts__free(good);
}

/* Fields out of range, with every checksum made right: refused with a message naming them. */
static void ps_expect(const uint8_t *good, size_t len, size_t off, uint64_t val, int width,
                      const char *problem)
{
    uint8_t *p = ts__malloc(len);
    assert_non_null(p);
    memcpy(p, good, len);
    if (width == 1)
        p[off] = (uint8_t)val;
    else if (width == 4)
        ts__put_u32le(p + off, (uint32_t)val);
    else
        ts__put_u64le(p + off, val);
    snapfix_rehash(p, len);
    ps_sink s;
    tsd_snapfile_head head;
    char err[1024];
    int rc = ps_read(p, len, &s, &head, err, sizeof(err));
    ps_sink_free(&s);
    if (rc == 0 || strstr(err, problem) == NULL) {
        print_error("want \"%s\", got %d \"%s\"\n", problem, rc, err);
        fail();
    }
    ts__free(p);
}

static void test_ps_fields_that_lie(void **state)
{
    (void)state;
    size_t len;
    int wrc;
    uint8_t *good = ps_file(&len, 0, &wrc);
    assert_int_equal(wrc, 0);
    /* No bins, streams or tables: the section follows three empty ones. */
    size_t sec = TSD_SNAP_HDR_SIZE + 2 * TSD_SNAP_SEC_SIZE;
    assert_memory_equal(good + sec, "TSDPSRV", 8);
    size_t w = sec + TSD_SNAP_SEC_SIZE + 2; /* w's fixed header */
    size_t sp = w + 80 + 8 + TSD_SNAP_RING_SIZE + 8 + 2 * (5 * 4 + 8) + 2;
    size_t e = sp + 80 + 8 + 3 * TSD_SNAP_RING_SIZE + 8 + 4; /* emb's fixed header */
    ps_expect(good, len, sec + 8, 1000000, 8, "more than the file can hold");
    ps_expect(good, len, sec + 24, 4, 8, "claims 4 rows, the tables hold 3");
    ps_expect(good, len, w, TS_PS_OPT_COUNT_, 1, "parameter 'w': the optimizer");
    ps_expect(good, len, w + 1, 2, 1, "parameter 'w': the mode or the flags");
    ps_expect(good, len, w + 3, 1, 1, "parameter 'w': a reserved field");
    ps_expect(good, len, w + 12, 0, 4, "the version ring's length");
    ps_expect(good, len, w + 12, TSD_PS_RING + 1, 4, "the version ring's length");
    ps_expect(good, len, w + 48, 1ull << 40, 8, "claims 1099511627776 elements");
    ps_expect(good, len, w + 72, 8, 8, "entry 0 of its version ring");
    ps_expect(good, len, sp + 4, 0, 4, "parameter 's': sync_k or the tolerance");
    ps_expect(good, len, sp + 8, TSD_PS_RING, 4, "parameter 's': sync_k or the tolerance");
    ps_expect(good, len, sp + 56, 1, 8, "parameter 's': the Adam step count");
    ps_expect(good, len, e, 0, 4, "embedding table 'emb': dim");
    ps_expect(good, len, e + 5, TS_PSW_INIT_COUNT_, 1, "'emb': the initializer");
    ps_expect(good, len, e + 16, 2, 8, "'emb': the row count");
    ps_expect(good, len, e + 16, 1ull << 40, 8, "row 2 has id 1099511627776, out of range");
    ps_expect(good, len, e + 72, 1ull << 32, 8, "'emb': the row count");
    ts__free(good);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_files_written_before_load_and_write_back),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_tensor_bin_flag),
        cmocka_unit_test(test_truncated_at_every_byte),
        cmocka_unit_test(test_flipped_byte_in_each_section),
        cmocka_unit_test(test_lengths_and_fields_that_lie),
        cmocka_unit_test(test_sink_failures),
        cmocka_unit_test(test_streams_round_trip),
        cmocka_unit_test(test_streams_seed),
        cmocka_unit_test(test_streams_truncated_and_flipped),
        cmocka_unit_test(test_streams_rules),
        cmocka_unit_test(test_streams_counts_that_lie),
        cmocka_unit_test(test_streams_sink_failures),
        cmocka_unit_test(test_ps_round_trip),
        cmocka_unit_test(test_ps_fields_that_lie),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
