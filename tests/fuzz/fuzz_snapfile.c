/*
 * Fuzz target: the snapshot reader (server/snapfile.c), formats 1 to 5. The input is a
 * snapshot file, read from memory twice: as it is, and with every checksum recomputed
 * (snapfile_fix.h), so that mutated lengths, counts, records and stream fields reach the checks
 * behind the checksums. Properties:
 *   - the reader never asks its sink for more bytes in all than the file holds;
 *   - it fails with TS_EPROTO and a message naming the file, or succeeds; after a success the
 *     bins and items, streams, records and groups it handed over match the counts and sums of
 *     the header and the streams section, every item and record is a valid record
 *     (ts__fz_check_record), every stream keeps the rules (dense ids, pending ids inside
 *     [first_id, next_id), ascending per member, once per group), a bin's flags are known bits
 *     only, none before format 5, a tensor bin (format 5) holds one item that is one tensor of a
 *     known dtype with 1 to 8 dims laid out as TENSOR_BIN makes it, and writing them again in
 *     the file's format gives back exactly the input (one encoding of each snapshot).
 */
#define _GNU_SOURCE /* memfd_create */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "msg.h"
#include "proto.h"
#include "snapfile_fix.h"

#define FZ_LABEL "fuzz.snap"

/* What the reader handed over. */
typedef struct fz_sink {
    tsd_snapfile_bin *bins;
    size_t n_bins, bins_cap;
    uint8_t **items;
    size_t *lens;
    size_t n_items, items_cap;
    uint8_t *names; /* one TS_MAX_NAME_LEN slot per bin */
    uint64_t asked; /* bytes of item and record memory asked for */
    /* Streams: each with its own copies of what the reader lent. */
    struct fz_stream *streams;
    size_t n_streams, streams_cap;
    uint64_t records; /* records asked for */
    /* The parameter server (format 4): objects handed over, the last array asked for. */
    uint64_t ps_objects;
    void *ps_array;
    /* Replay tables (format 3): tables and records handed over, the records they announced, and
     * the last record asked for. */
    uint64_t tables, trecords, trecords_due;
    uint8_t *trecord;
} fz_sink;

typedef struct fz_group {
    tsd_snapfile_group g;
    uint8_t name[TS_MAX_NAME_LEN];
    tsd_snapfile_member *m;
    uint8_t *mnames; /* one TS_MAX_NAME_LEN slot per member */
    uint8_t **pend;
} fz_group;

typedef struct fz_stream {
    tsd_snapfile_stream s;
    uint8_t name[TS_MAX_NAME_LEN];
    uint8_t *entries;
    fz_group *groups; /* s.n_groups of them, n_groups handed over so far */
    uint32_t n_groups;
    tsd_snapfile_group *view; /* the writer's array, built for the rewrite */
} fz_stream;

static int fz_grow(void **arr, size_t *cap, size_t n, size_t sz)
{
    if (n < *cap)
        return 0;
    size_t want = *cap * 2 + 8;
    void *na = ts__realloc(*arr, want * sz);
    FZ_CHECK(na != NULL);
    *arr = na;
    *cap = want;
    return 0;
}

static int on_bin(void *arg, const uint8_t *name, size_t name_len, uint64_t version,
                  uint32_t n_items, uint32_t flags)
{
    fz_sink *s = arg;
    FZ_CHECK(name_len <= TS_MAX_NAME_LEN);
    size_t cap = s->bins_cap;
    fz_grow((void **)&s->bins, &s->bins_cap, s->n_bins, sizeof(*s->bins));
    if (s->bins_cap != cap) {
        uint8_t *nn = ts__realloc(s->names, s->bins_cap * TS_MAX_NAME_LEN);
        FZ_CHECK(nn != NULL);
        s->names = nn;
    }
    uint8_t *slot = s->names + s->n_bins * TS_MAX_NAME_LEN;
    if (name_len > 0)
        memcpy(slot, name, name_len);
    s->bins[s->n_bins++] = (tsd_snapfile_bin){.name = NULL,
                                              .first = s->n_items,
                                              .version = version,
                                              .n_items = n_items,
                                              .flags = flags,
                                              .name_len = (uint8_t)name_len};
    return 0;
}

static uint8_t *on_item(void *arg, size_t len)
{
    fz_sink *s = arg;
    s->asked += len;
    size_t cap = s->items_cap;
    fz_grow((void **)&s->items, &s->items_cap, s->n_items, sizeof(*s->items));
    if (s->items_cap != cap) {
        size_t *nl = ts__realloc(s->lens, s->items_cap * sizeof(*s->lens));
        FZ_CHECK(nl != NULL);
        s->lens = nl;
    }
    uint8_t *p = ts__malloc(len);
    FZ_CHECK(p != NULL);
    s->items[s->n_items] = p;
    s->lens[s->n_items++] = len;
    return p;
}

static int on_stream(void *arg, const tsd_snapfile_stream *st)
{
    fz_sink *s = arg;
    FZ_CHECK(st->name_len >= 1 && st->groups == NULL);
    FZ_CHECK(st->first_id >= 1 && st->last_id + 1 >= st->first_id);
    FZ_CHECK(st->last_id + 1 - st->first_id <= TS_STREAM_MAX_ENTRIES);
    FZ_CHECK(st->n_groups <= TS_STREAM_MAX_GROUPS);
    fz_grow((void **)&s->streams, &s->streams_cap, s->n_streams, sizeof(*s->streams));
    fz_stream *f = &s->streams[s->n_streams++];
    memset(f, 0, sizeof(*f));
    f->s = *st;
    memcpy(f->name, st->name, st->name_len);
    size_t tl = (size_t)(st->last_id + 1 - st->first_id) * TSD_SNAP_ENTRY_SIZE;
    f->entries = ts__malloc(tl + 1);
    FZ_CHECK(f->entries != NULL);
    memcpy(f->entries, st->entries, tl);
    f->s.first_record = s->n_items; /* its records come next, after the items so far */
    f->groups = ts__calloc(st->n_groups + 1, sizeof(*f->groups));
    FZ_CHECK(f->groups != NULL);
    return 0;
}

static uint8_t *on_record(void *arg, size_t len)
{
    fz_sink *s = arg;
    FZ_CHECK(s->n_streams > 0);
    s->records++;
    return on_item(arg, len);
}

static int on_group(void *arg, const tsd_snapfile_group *g)
{
    fz_sink *s = arg;
    FZ_CHECK(s->n_streams > 0);
    fz_stream *f = &s->streams[s->n_streams - 1];
    FZ_CHECK(f->n_groups < f->s.n_groups);
    FZ_CHECK(g->name_len >= 1);
    FZ_CHECK(g->next_id >= f->s.first_id && g->next_id <= f->s.last_id + 1);
    fz_group *c = &f->groups[f->n_groups++];
    c->g = *g;
    memcpy(c->name, g->name, g->name_len);
    uint32_t n = g->n_members;
    c->m = ts__calloc(n + 1, sizeof(*c->m));
    c->mnames = ts__calloc(n + 1, TS_MAX_NAME_LEN);
    c->pend = ts__calloc(n + 1, sizeof(*c->pend));
    FZ_CHECK(c->m != NULL && c->mnames != NULL && c->pend != NULL);
    for (uint32_t k = 0; k < n; k++) {
        const tsd_snapfile_member *m = &g->members[k];
        c->m[k] = *m;
        if (m->name_len > 0)
            memcpy(c->mnames + (size_t)k * TS_MAX_NAME_LEN, m->name, m->name_len);
        size_t tl = (size_t)m->n_pend * TSD_SNAP_PEND_SIZE;
        c->pend[k] = ts__malloc(tl + 1);
        FZ_CHECK(c->pend[k] != NULL);
        memcpy(c->pend[k], m->pend, tl);
        /* Ids ascending inside [first_id, next_id); never pending twice in the group. */
        uint64_t prev = 0;
        for (uint32_t i = 0; i < m->n_pend; i++) {
            uint64_t id;
            uint32_t d, r;
            tsd_snapfile_pend_get(m->pend, i, &id, &d, &r);
            FZ_CHECK(id > prev && id >= f->s.first_id && id < g->next_id);
            prev = id;
            for (uint32_t j = 0; j < k; j++)
                for (uint32_t x = 0; x < g->members[j].n_pend; x++) {
                    uint64_t other;
                    tsd_snapfile_pend_get(g->members[j].pend, x, &other, &d, &r);
                    FZ_CHECK(other != id);
                }
        }
    }
    return 0;
}

/* Format 4: parameters and tables are taken, their arrays counted and dropped. */
static int on_param(void *arg, const tsd_snapfile_param *p)
{
    fz_sink *s = arg;
    FZ_CHECK(p->ring_n >= 1 && p->ring_n <= TSD_PS_RING && p->ring != NULL);
    s->ps_objects++;
    return 0;
}

static int on_emb(void *arg, const tsd_snapfile_emb *t)
{
    fz_sink *s = arg;
    FZ_CHECK(t->dim >= 1 && t->dim <= TSD_PS_MAX_DIM);
    s->ps_objects++;
    return 0;
}

static void *on_ps_array(void *arg, size_t len)
{
    fz_sink *s = arg;
    s->asked += len;
    ts__free(s->ps_array);
    s->ps_array = ts__malloc(len ? len : 1);
    return s->ps_array;
}

static int on_table(void *arg, const tsd_snapfile_table *t)
{
    fz_sink *s = arg;
    FZ_CHECK(t->name_len >= 1 && t->capacity >= 1 && t->n_items <= t->capacity);
    FZ_CHECK(s->trecords == s->trecords_due); /* the last table got all of its records */
    s->tables++;
    s->trecords_due += t->n_items;
    return 0;
}

static uint8_t *on_trecord(void *arg, size_t len)
{
    fz_sink *s = arg;
    FZ_CHECK(s->tables > 0 && s->trecords < s->trecords_due);
    s->asked += len;
    s->trecords++;
    ts__free(s->trecord);
    s->trecord = ts__malloc(len ? len : 1);
    return s->trecord;
}

static void sink_free(fz_sink *s)
{
    ts__free(s->ps_array);
    ts__free(s->trecord);
    for (size_t k = 0; k < s->n_streams; k++) {
        fz_stream *f = &s->streams[k];
        for (uint32_t g = 0; g < f->n_groups; g++) {
            for (uint32_t m = 0; m < f->groups[g].g.n_members; m++)
                ts__free(f->groups[g].pend[m]);
            ts__free(f->groups[g].m);
            ts__free(f->groups[g].mnames);
            ts__free(f->groups[g].pend);
        }
        ts__free(f->groups);
        ts__free(f->entries);
        ts__free(f->view);
    }
    ts__free(s->streams);
    for (size_t i = 0; i < s->n_items; i++)
        ts__free(s->items[i]);
    ts__free(s->items);
    ts__free(s->lens);
    ts__free(s->bins);
    ts__free(s->names);
}

static void item_of(void *arg, size_t index, const uint8_t **data, size_t *len)
{
    const fz_sink *s = arg;
    FZ_CHECK(index < s->n_items);
    *data = s->items[index];
    *len = s->lens[index];
}

/*
 * 1 when rec is what a tensor bin holds, checked here apart from the reader: its root decodes to
 * one tensor of a known dtype with 1 to TS_MAX_NDIM dims, and the record is exactly
 * ts__rows_rec_size of that shape, with the head TENSOR_BIN writes.
 */
static int fz_tensor_record(const uint8_t *rec, size_t len)
{
    uint8_t *copy = ts__malloc_aligned(len);
    FZ_CHECK(copy != NULL);
    memcpy(copy, rec, len);
    ts__rbuf *rb = ts__rbuf_new(copy, len, NULL);
    FZ_CHECK(rb != NULL);
    ts_value_t *v = ts__record_decode(rb, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    int ok = 0;
    const ts_tensor_t *t = v != NULL ? ts_value_tensor(v) : NULL;
    if (t != NULL && t->ndim >= 1 && t->ndim <= TS_MAX_NDIM) {
        uint64_t dims[TS_MAX_NDIM], size;
        for (int i = 0; i < t->ndim; i++)
            dims[i] = (uint64_t)t->shape[i];
        size_t head = ts__rows_rec_head_size((unsigned)t->ndim);
        uint8_t want[128];
        if (ts__rows_rec_size((uint8_t)t->dtype, (unsigned)t->ndim, dims, &size) == 0 &&
            size == len && head <= sizeof(want) && head <= len) {
            ts__rows_rec_head_write(want, (uint8_t)t->dtype, (unsigned)t->ndim, dims, len - head);
            ok = memcmp(want, rec, head) == 0;
        }
    }
    if (v != NULL)
        ts__record_tree_free(v);
    return ok;
}

/* Write what was read back to a file in memory; it must be the input, byte for byte. */
static void check_rewrite(fz_sink *s, const tsd_snapfile_head *head, const uint8_t *data,
                          size_t size)
{
    for (size_t b = 0; b < s->n_bins; b++)
        s->bins[b].name = s->names + b * TS_MAX_NAME_LEN;
    /* The writer's view of the streams: pointers into the copies, which stop moving now. */
    tsd_snapfile_stream *streams = ts__calloc(s->n_streams + 1, sizeof(*streams));
    FZ_CHECK(streams != NULL);
    for (size_t k = 0; k < s->n_streams; k++) {
        fz_stream *f = &s->streams[k];
        FZ_CHECK(f->n_groups == f->s.n_groups);
        f->view = ts__calloc(f->n_groups + 1, sizeof(*f->view));
        FZ_CHECK(f->view != NULL);
        for (uint32_t g = 0; g < f->n_groups; g++) {
            fz_group *c = &f->groups[g];
            for (uint32_t m = 0; m < c->g.n_members; m++) {
                c->m[m].name = c->mnames + (size_t)m * TS_MAX_NAME_LEN;
                c->m[m].pend = c->pend[m];
            }
            f->view[g] = c->g;
            f->view[g].name = c->name;
            f->view[g].members = c->m;
        }
        streams[k] = f->s;
        streams[k].name = f->name;
        streams[k].entries = f->entries;
        streams[k].groups = f->view;
    }
    int fd = memfd_create("fuzz_snapfile", MFD_CLOEXEC);
    if (fd < 0) {
        ts__free(streams);
        return; /* no memfd here: the other properties still hold */
    }
    FZ_CHECK(tsd_snapfile_write(fd, head, s->bins, streams, item_of, s) == 0);
    ts__free(streams);
    FZ_CHECK(lseek(fd, 0, SEEK_END) == (off_t)size);
    uint8_t *back = ts__malloc(size);
    FZ_CHECK(back != NULL);
    FZ_CHECK(pread(fd, back, size, 0) == (ssize_t)size);
    FZ_CHECK(memcmp(back, data, size) == 0);
    ts__free(back);
    close(fd);
}

static void check(const uint8_t *data, size_t size)
{
    fz_sink s = {0};
    tsd_snapfile_sink sink = {.arg = &s,
                              .bin = on_bin,
                              .item = on_item,
                              .stream = on_stream,
                              .record = on_record,
                              .group = on_group,
                              .table = on_table,
                              .trecord = on_trecord,
                              .param = on_param,
                              .emb = on_emb,
                              .ps_array = on_ps_array};
    tsd_snapfile_head head;
    char err[1024];
    err[0] = '\0';
    int rc = tsd_snapfile_read_mem(data, size, FZ_LABEL, &sink, &head, err, sizeof(err));
    FZ_CHECK(s.asked <= size);
    if (rc != 0) {
        FZ_CHECK(rc == TS_EPROTO);
        FZ_CHECK(strstr(err, "snapshot " FZ_LABEL) == err);
    } else {
        FZ_CHECK(head.n_bins == s.n_bins && head.n_items + head.n_records == s.n_items);
        FZ_CHECK(head.n_streams == s.n_streams && head.n_records == s.records);
        FZ_CHECK(head.format >= 2 || s.n_streams == 0);
        FZ_CHECK(head.n_params + head.n_embs == s.ps_objects);
        uint64_t bytes = 0, sbytes = 0;
        size_t items = 0;
        for (size_t b = 0; b < s.n_bins; b++) {
            FZ_CHECK(s.bins[b].first == items);
            uint32_t fl = s.bins[b].flags;
            FZ_CHECK((fl & ~TSD_SNAP_BIN_KNOWN) == 0);
            FZ_CHECK(head.format >= TSD_SNAP_FORMAT_FLAGS || fl == 0);
            if ((fl & TSD_SNAP_BIN_TENSOR) != 0) {
                FZ_CHECK(s.bins[b].n_items == 1);
                FZ_CHECK(fz_tensor_record(s.items[items], s.lens[items]));
            }
            items += s.bins[b].n_items;
        }
        FZ_CHECK(items == head.n_items);
        for (size_t i = 0; i < s.n_items; i++) {
            if (i < items)
                bytes += s.lens[i];
            else
                sbytes += s.lens[i];
            FZ_CHECK(ts__fz_check_record(s.items[i], s.lens[i]) == 0);
        }
        FZ_CHECK(bytes == head.bytes && sbytes == head.stream_bytes);
        FZ_CHECK(s.trecords == s.trecords_due);
        /* The rewrite holds no tables nor parameter server state: only files without any. */
        if (s.ps_objects == 0 && s.tables == 0)
            check_rewrite(&s, &head, data, size);
    }
    sink_free(&s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    check(data, size);
    if (size >= TSD_SNAP_HDR_SIZE) {
        uint8_t *fixed = ts__malloc(size);
        FZ_CHECK(fixed != NULL);
        memcpy(fixed, data, size);
        snapfix_rehash(fixed, size);
        if (memcmp(fixed, data, size) != 0)
            check(fixed, size);
        ts__free(fixed);
    }
    return 0;
}
