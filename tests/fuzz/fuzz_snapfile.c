/*
 * Fuzz target: the snapshot reader (server/snapfile.c). The input is a snapshot file, read from
 * memory twice: as it is, and with every checksum recomputed (snapfile_fix.h), so that mutated
 * lengths, counts and records reach the checks behind the checksums. Properties:
 *   - the reader never asks its sink for more bytes in all than the file holds;
 *   - it fails with TS_EPROTO and a message naming the file, or succeeds; after a success the
 *     bins and items it handed over match the header's counts and sums, every item is a valid
 *     record (ts__fz_check_record), and writing them again gives back exactly the input
 *     (the format has one encoding of each snapshot).
 */
#define _GNU_SOURCE /* memfd_create */
#include "fuzz.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

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
    uint64_t asked; /* bytes of item memory asked for */
} fz_sink;

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
                  uint32_t n_items)
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

static void sink_free(fz_sink *s)
{
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

/* Write what was read back to a file in memory; it must be the input, byte for byte. */
static void check_rewrite(fz_sink *s, const tsd_snapfile_head *head, const uint8_t *data,
                          size_t size)
{
    for (size_t b = 0; b < s->n_bins; b++)
        s->bins[b].name = s->names + b * TS_MAX_NAME_LEN;
    int fd = memfd_create("fuzz_snapfile", MFD_CLOEXEC);
    if (fd < 0)
        return; /* no memfd here: the other properties still hold */
    FZ_CHECK(tsd_snapfile_write(fd, head, s->bins, item_of, s) == 0);
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
    tsd_snapfile_sink sink = {.arg = &s, .bin = on_bin, .item = on_item};
    tsd_snapfile_head head;
    char err[1024];
    err[0] = '\0';
    int rc = tsd_snapfile_read_mem(data, size, FZ_LABEL, &sink, &head, err, sizeof(err));
    FZ_CHECK(s.asked <= size);
    if (rc != 0) {
        FZ_CHECK(rc == TS_EPROTO);
        FZ_CHECK(strstr(err, "snapshot " FZ_LABEL) == err);
    } else {
        FZ_CHECK(head.n_bins == s.n_bins && head.n_items == s.n_items);
        uint64_t bytes = 0;
        size_t items = 0;
        for (size_t b = 0; b < s.n_bins; b++) {
            FZ_CHECK(s.bins[b].first == items);
            items += s.bins[b].n_items;
        }
        FZ_CHECK(items == s.n_items);
        for (size_t i = 0; i < s.n_items; i++) {
            bytes += s.lens[i];
            FZ_CHECK(ts__fz_check_record(s.items[i], s.lens[i]) == 0);
        }
        FZ_CHECK(bytes == head.bytes);
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
