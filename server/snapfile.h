/*
 * The snapshot file format of tensord (the layout is drawn at the top of snapfile.c): the
 * checksum, a writer over a file descriptor and a strict, bounded reader. Nothing here knows
 * the event loop, the store or the server, so the format links into the fuzz target and the
 * unit test without libuv; server/snapshot.c runs the jobs around it.
 *
 * Thread: any; the functions keep no state between calls.
 */
#ifndef TSD_SNAPFILE_H
#define TSD_SNAPFILE_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"

#define TSD_SNAP_FORMAT   1  /* the format version in the header; the reader reads only this */
#define TSD_SNAP_HDR_SIZE 64 /* bytes of the file header */
#define TSD_SNAP_END_SIZE 32 /* bytes of the trailer */

/* A 64-bit hash of len bytes (xxHash64-style); the snapshot checksums. */
uint64_t tsd_hash64(const void *p, size_t len, uint64_t seed);

/* What the file header says (and the trailer repeats). */
typedef struct tsd_snapfile_head {
    uint64_t counter; /* the server's change counter when the snapshot was taken */
    uint64_t n_bins;
    uint64_t n_items; /* over all bins */
    uint64_t bytes;   /* record bytes over all items */
    uint64_t wall_ms; /* wall clock when written, ms since the epoch (informative) */
} tsd_snapfile_head;

/* One bin handed to the writer. */
typedef struct tsd_snapfile_bin {
    const uint8_t *name; /* name_len bytes, borrowed */
    size_t first;        /* index of its first item, as the item function counts them */
    uint64_t version;
    uint32_t n_items; /* its items are first .. first + n_items - 1 */
    uint8_t name_len;
} tsd_snapfile_bin;

/*
 * The writer's access to item index (0 .. n_items - 1 over the whole snapshot): its record
 * bytes (borrowed until the writer returns) and their length.
 */
typedef void (*tsd_snapfile_item_fn)(void *arg, size_t index, const uint8_t **data, size_t *len);

/*
 * Sort bins into the file's order: by name, bytewise, a shorter name first when one is a prefix
 * of the other. The writer writes bins in the order given, so call this first.
 */
void tsd_snapfile_sort(tsd_snapfile_bin *bins, size_t n);

/*
 * Write a whole snapshot to fd (at its current offset): the header from head (head->n_bins is
 * the length of bins; n_items and bytes must be the sums over the bins' items, as the reader
 * checks them), every bin and its items, the trailer. Writes go through a 1 MiB buffer; large
 * records go straight to the file. Neither syncs nor closes fd. Returns 0, -ENOMEM, or the
 * negated errno of the write that failed.
 */
int tsd_snapfile_write(int fd, const tsd_snapfile_head *head, const tsd_snapfile_bin *bins,
                       tsd_snapfile_item_fn item, void *arg);

/*
 * What the reader hands its caller as it decodes, in file order. The reader checks every
 * length against the bytes left in the file before it calls item (so the memory it asks for
 * never exceeds the file's size in all), and a bin's header checksum before it calls bin.
 */
typedef struct tsd_snapfile_sink {
    void *arg; /* passed to the functions; the reader never reads it */
    /*
     * A bin begins: its name (borrowed for the call), version and item count; its n_items
     * items come next. 0 to go on, anything else stops the reader (out of memory).
     */
    int (*bin)(void *arg, const uint8_t *name, size_t name_len, uint64_t version, uint32_t n_items);
    /*
     * Memory for the next item's len bytes (TS_REC_HDR_SIZE <= len <= the bytes left): the
     * reader reads the record into it, then checks its checksum and validates it as tensord
     * validates a PUT. The memory belongs to the caller from this call on, whatever the reader
     * finds afterwards. NULL stops the reader (out of memory).
     */
    uint8_t *(*item)(void *arg, size_t len);
    /*
     * Optional: how bin names are written into error messages (tensord passes
     * tsd_name_printable); when NULL, bytes outside printable ASCII appear as '?'.
     */
    void (*name_printable)(const uint8_t *name, size_t len, char *out, size_t cap);
} tsd_snapfile_sink;

/*
 * Read the snapshot in the size bytes of fd from its current offset, or in p[0..len), handing
 * each bin and item to sink. The whole file must be good: every checksum, the counts and sums
 * against the header and the trailer, every record valid, nothing after the trailer. Returns 0
 * and fills *head, or fails with a message in err naming label (the file's path) and the
 * problem ("... is truncated: ...", "... is damaged: ...", or "format N is not supported"):
 * TS_EPROTO for a bad file, TS_ENOMEM when sink refused (or the reader's own buffer could not
 * be had), the negated errno of a failed read. After a failure the caller frees whatever its
 * sink took; nothing it was handed is known to be good.
 */
int tsd_snapfile_read_fd(int fd, uint64_t size, const char *label, const tsd_snapfile_sink *sink,
                         tsd_snapfile_head *head, char *err, size_t err_cap);
int tsd_snapfile_read_mem(const uint8_t *p, size_t len, const char *label,
                          const tsd_snapfile_sink *sink, tsd_snapfile_head *head, char *err,
                          size_t err_cap);

#endif /* TSD_SNAPFILE_H */
