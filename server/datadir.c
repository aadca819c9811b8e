/*
 * The data directory (--data-dir DIR): items kept in memory-mapped files, so that bins survive
 * a restart and may exceed RAM (the page cache holds what is in use; the rest stays on disk).
 *
 * One file per item, DIR/<id>.tsi, where id is 16 lower-case hex digits:
 *
 *   offset  size  field
 *   0       8     magic "tsdfile\0"
 *   8       u32   format version (TSD_DATADIR_FORMAT)
 *   12      u32   flags: 0x01 the item of a tensor bin, 0x02 it replaced its bin's content
 *   16      u64   id (the same as in the file name)
 *   24      u64   sequence number (the bin's version when the item was stored)
 *   32      u64   record length
 *   40      u64   file length (the file's size; at least 4096 + record length)
 *   48      u8    bin name length
 *   49      255   bin name, zero-padded
 *   304     ...   zero
 *   4088    u64   checksum: tsd_hash64 of bytes [0, 4088)
 *   4096    ...   the record (page-aligned, so tensor data keeps its 64-byte alignment)
 *
 * The whole file is mapped MAP_SHARED and writable from the moment an upload starts, so the
 * body is received straight into the page cache. The header stays zero until the item is
 * stored in a bin (tsd_datadir_commit): a file whose header is all zero is an upload that
 * never completed, and is removed at start. When the store lets go of an item (replaced, taken
 * by GET, deleted) the file is renamed to <id>.gone at once, so it never comes back after a
 * restart, and unlinked when the last reference (a reply still being written, a descriptor
 * about to be sent) goes. At shutdown the store lets go of nothing: the files stay.
 *
 * Loop thread only, like the store.
 */
#define _GNU_SOURCE /* fallocate */
#include "server.h"

#include <assert.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include "record.h"
#include "snapfile.h"

#define DD_MAGIC       "tsdfile" /* 8 bytes with its NUL */
#define DD_OFF_FORMAT  8         /* the header's fields, by offset */
#define DD_OFF_FLAGS   12
#define DD_OFF_ID      16
#define DD_OFF_SEQ     24
#define DD_OFF_RECLEN  32
#define DD_OFF_FILELEN 40
#define DD_OFF_NAMELEN 48
#define DD_OFF_NAME    49
#define DD_OFF_SUM     (TSD_DATADIR_HDR - 8)
#define DD_SUM_SEED    0x7473646669606531ull /* seed of the header checksum */
#define DD_PAGE        ((uint64_t)4096)      /* bytes; files take whole pages of disk */
#define DD_NAME_CAP    32                    /* bytes of "<16 hex>.tsi.damaged" and its NUL */
#define DD_FLAGS_KNOWN (TSD_DATADIR_TENSOR | TSD_DATADIR_REPLACE)
/*
 * Divisor of the file system's free space at start that the default --max-disk leaves unused:
 * the files may take 3/4 of it (plus what they held already), so the disk never fills for the
 * other users of the machine (logs, the system) because of tensord.
 */
#define DD_DEFAULT_FREE_NUM 3u
#define DD_DEFAULT_FREE_DEN 4u

_Static_assert(DD_OFF_NAME + TS_MAX_NAME_LEN <= DD_OFF_SUM, "the name fits the header");
_Static_assert(sizeof(DD_MAGIC) == 8, "the magic is 8 bytes");

struct tsd_datadir {
    char *path;          /* DIR as given (for log lines) */
    int dirfd;           /* DIR, for the *at calls */
    int lock_fd;         /* DIR/LOCK, flocked for the process's life */
    uint64_t next_id;    /* id of the next file */
    uint64_t last_seq;   /* greatest sequence number given or loaded */
    uint64_t data_min;   /* bytes; smaller uploads stay in memory */
    uint64_t max_disk;   /* bytes of files at most; 0 = unlimited */
    uint64_t disk_bytes; /* bytes of the files that exist (whole pages) */
    uint64_t files;      /* files that exist (committed or not, dropped ones included) */
    uint64_t loaded;     /* files loaded at start */
    uint64_t damaged;    /* files refused at start */
    uint64_t refused;    /* uploads refused: --max-disk or the file could not be made */
    int last_errno;      /* why the last alloc failed (0: --max-disk) */
    size_t live;         /* file items not yet released */
    int closing;         /* tsd_datadir_free ran: free the rest when the last item goes */
};

/* datadir.c's state of one file item; own comes first, so the item is the struct. */
typedef struct dd_file {
    tsd_item_own own;
    tsd_datadir *dd;
    uint64_t id;
    uint64_t seq;
    uint64_t disk;  /* bytes counted in disk_bytes */
    uint8_t *map;   /* the whole file, map_len bytes */
    size_t map_len; /* the file length */
    int committed;  /* the header is written: the file holds a stored item */
    int dropped;    /* renamed to <id>.gone */
    unsigned flags; /* TSD_DATADIR_* of the header */
} dd_file;

static void dd_name(char *out, uint64_t id, const char *suffix)
{
    snprintf(out, DD_NAME_CAP, "%016llx%s", (unsigned long long)id, suffix);
}

static dd_file *file_of(const tsd_item *it)
{
    const tsd_item_own *own = (const tsd_item_own *)(const void *)it;
    return (dd_file *)own->ext;
}

/* Bytes of disk a file of len bytes takes (whole pages); 0 on overflow. */
static uint64_t disk_of(uint64_t len)
{
    uint64_t d;
    if (ts__align_up_checked(len, DD_PAGE, &d) != 0)
        return 0;
    return d;
}

/* Fill the item fields of f for its mapping. */
static void file_item_init(dd_file *f, uint64_t rec_len)
{
    tsd_item_own *own = &f->own;
    own->it.slot = TSD_ITEM_OWN;
    own->it.slen = 0;
    own->it.next = NULL;
    atomic_init(&own->it.refs, 1);
    own->data = f->map + TSD_DATADIR_HDR;
    own->len = (size_t)rec_len;
    own->alloc_len = f->map_len;
    own->backing = TSD_BACK_FILE;
    own->live = (f->flags & TSD_DATADIR_TENSOR) != 0;
    own->fd = -1;
    own->file_off = TSD_DATADIR_HDR;
    own->file_len = f->map_len;
    own->ext = f;
}

/* The datadir itself goes once it is closed and its last item is released. */
static void dd_destroy(tsd_datadir *dd)
{
    if (dd->lock_fd >= 0)
        close(dd->lock_fd);
    if (dd->dirfd >= 0)
        close(dd->dirfd);
    ts__free(dd->path);
    ts__free(dd);
}

int tsd_datadir_alloc(tsd_server *srv, size_t len, tsd_item **out)
{
    tsd_datadir *dd = srv->datadir;
    if (dd == NULL || (uint64_t)len < dd->data_min)
        return 1;
    uint64_t file_len = (uint64_t)len + TSD_DATADIR_HDR;
    uint64_t disk = disk_of(file_len);
    if (file_len < len || disk == 0 || file_len > SIZE_MAX) {
        dd->last_errno = EFBIG;
        dd->refused++;
        return TS_EOOM;
    }
    if (dd->max_disk != 0 &&
        (dd->disk_bytes > dd->max_disk || disk > dd->max_disk - dd->disk_bytes)) {
        dd->last_errno = 0;
        dd->refused++;
        return TS_EOOM;
    }
    dd_file *f = ts__calloc(1, sizeof(*f));
    if (f == NULL) {
        dd->last_errno = ENOMEM;
        dd->refused++;
        return TS_ENOMEM;
    }
    char name[DD_NAME_CAP];
    uint64_t id = dd->next_id++;
    dd_name(name, id, ".tsi");
    int fd = openat(dd->dirfd, name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        goto fail;
    /*
     * Blocks are allocated now, so that a full disk refuses the write here instead of killing
     * the daemon with SIGBUS when a page of the mapping is first written. File systems without
     * fallocate get a sparse file (then the disk must not fill: see --max-disk). Not
     * posix_fallocate: where the file system lacks fallocate, glibc's emulates it by writing
     * every block, which would hold the loop for as long as writing the whole file takes.
     */
    int frc = fallocate(fd, 0, 0, (off_t)file_len) == 0 ? 0 : errno;
    if (frc == EOPNOTSUPP || frc == ENOSYS)
        frc = ftruncate(fd, (off_t)file_len) == 0 ? 0 : errno;
    if (frc != 0) {
        errno = frc;
        goto fail_unlink;
    }
    void *map = mmap(NULL, (size_t)file_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED)
        goto fail_unlink;
    close(fd);
    f->dd = dd;
    f->id = id;
    f->map = map;
    f->map_len = (size_t)file_len;
    f->disk = disk;
    file_item_init(f, len);
    dd->disk_bytes += disk;
    dd->files++;
    dd->live++;
    *out = &f->own.it;
    return 0;

fail_unlink : {
    int e = errno;
    (void)unlinkat(dd->dirfd, name, 0);
    close(fd);
    errno = e;
}
fail:
    dd->last_errno = errno != 0 ? errno : EIO;
    dd->refused++;
    ts__free(f);
    tsd_log(TSD_LOG_WARN, "--data-dir %s: cannot make %s (%llu bytes): %s", dd->path, name,
            (unsigned long long)file_len, strerror(dd->last_errno));
    return TS_EOOM;
}

void tsd_datadir_refusal(const tsd_server *srv, int rc, size_t len, char *buf, size_t cap)
{
    const tsd_datadir *dd = srv->datadir;
    (void)rc;
    if (dd == NULL) {
        snprintf(buf, cap, "no data directory");
    } else if (dd->last_errno == 0) {
        snprintf(buf, cap,
                 "--max-disk reached: %llu bytes in files of %llu, the %zu-byte item needs %llu",
                 (unsigned long long)dd->disk_bytes, (unsigned long long)dd->max_disk, len,
                 (unsigned long long)disk_of((uint64_t)len + TSD_DATADIR_HDR));
    } else {
        snprintf(buf, cap, "the %zu-byte item's file in --data-dir could not be made: %s", len,
                 strerror(dd->last_errno));
    }
}

/* Write the header of f into its mapping (flags, seq and name set). */
static void header_write(dd_file *f, const uint8_t *bin, size_t bin_len)
{
    uint8_t *h = f->map;
    memset(h, 0, TSD_DATADIR_HDR);
    memcpy(h, DD_MAGIC, 8);
    ts__put_u32le(h + DD_OFF_FORMAT, TSD_DATADIR_FORMAT);
    ts__put_u32le(h + DD_OFF_FLAGS, f->flags);
    ts__put_u64le(h + DD_OFF_ID, f->id);
    ts__put_u64le(h + DD_OFF_SEQ, f->seq);
    ts__put_u64le(h + DD_OFF_RECLEN, f->own.len);
    ts__put_u64le(h + DD_OFF_FILELEN, f->map_len);
    h[DD_OFF_NAMELEN] = (uint8_t)bin_len;
    memcpy(h + DD_OFF_NAME, bin, bin_len);
    ts__put_u64le(h + DD_OFF_SUM, tsd_hash64(h, DD_OFF_SUM, DD_SUM_SEED));
}

int tsd_datadir_commit(tsd_server *srv, tsd_item *it, const uint8_t *bin, size_t bin_len,
                       unsigned flags)
{
    tsd_item_own *own = tsd_item_as_own(it);
    if (own == NULL || own->backing != TSD_BACK_FILE)
        return 0;
    dd_file *f = own->ext;
    tsd_datadir *dd = f->dd;
    assert(bin_len <= TS_MAX_NAME_LEN);
    /* The bin's version when the caller just stored it; later changes never go back. */
    uint64_t seq = srv != NULL ? srv->version : 0;
    if (seq <= dd->last_seq)
        seq = dd->last_seq + 1;
    dd->last_seq = seq;
    f->seq = seq;
    f->flags = flags & DD_FLAGS_KNOWN;
    f->own.live = (f->flags & TSD_DATADIR_TENSOR) != 0;
    header_write(f, bin, bin_len);
    f->committed = 1;
    return 0;
}

void tsd_datadir_drop(tsd_server *srv, tsd_item *it)
{
    (void)srv;
    tsd_item_own *own = tsd_item_as_own(it);
    if (own == NULL || own->backing != TSD_BACK_FILE)
        return;
    dd_file *f = own->ext;
    if (f->dropped || !f->committed)
        return;
    char from[DD_NAME_CAP], to[DD_NAME_CAP];
    dd_name(from, f->id, ".tsi");
    dd_name(to, f->id, ".gone");
    if (renameat(f->dd->dirfd, from, f->dd->dirfd, to) != 0) {
        /* Never let it come back: without a new name, it goes now (no descriptor can follow). */
        tsd_log(TSD_LOG_WARN, "--data-dir %s: cannot rename %s: %s; removing it", f->dd->path, from,
                strerror(errno));
        (void)unlinkat(f->dd->dirfd, from, 0);
        f->dropped = 2;
        return;
    }
    f->dropped = 1;
}

void tsd_datadir_release(tsd_item_own *own)
{
    dd_file *f = own->ext;
    tsd_datadir *dd = f->dd;
    tsd_reclaim_unmap(f->map, f->map_len, -1);
    /* Files of items stored and never let go of stay: that is what survives a restart. */
    if (!f->committed || f->dropped == 1) {
        char name[DD_NAME_CAP];
        dd_name(name, f->id, f->committed ? ".gone" : ".tsi");
        (void)unlinkat(dd->dirfd, name, 0);
    }
    dd->disk_bytes -= f->disk;
    dd->files--;
    dd->live--;
    ts__free(f);
    if (dd->closing && dd->live == 0)
        dd_destroy(dd);
}

int tsd_datadir_open_ro(tsd_server *srv, const tsd_item *it)
{
    (void)srv;
    const dd_file *f = file_of(it);
    char name[DD_NAME_CAP];
    dd_name(name, f->id, f->dropped == 1 ? ".gone" : ".tsi");
    int fd = openat(f->dd->dirfd, name, O_RDONLY | O_CLOEXEC);
    return fd >= 0 ? fd : -errno;
}

void tsd_datadir_stats_get(const tsd_server *srv, tsd_datadir_stats *st)
{
    memset(st, 0, sizeof(*st));
    const tsd_datadir *dd = srv->datadir;
    if (dd == NULL)
        return;
    st->disk_bytes = dd->disk_bytes;
    st->files = dd->files;
    st->max_disk = dd->max_disk;
    st->loaded = dd->loaded;
    st->damaged = dd->damaged;
    st->refused = dd->refused;
}

/* ---------------------------------------------------------------------------------------------
 * Start: lock, scan, validate, load
 */

/* Parse "<16 hex><suffix>" into *id. 1 when name has that form. */
static int parse_name(const char *name, const char *suffix, uint64_t *id)
{
    size_t sl = strlen(suffix);
    if (strlen(name) != 16 + sl || strcmp(name + 16, suffix) != 0)
        return 0;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char ch = name[i];
        unsigned d;
        if (ch >= '0' && ch <= '9')
            d = (unsigned)(ch - '0');
        else if (ch >= 'a' && ch <= 'f')
            d = (unsigned)(ch - 'a' + 10);
        else
            return 0;
        v = v << 4 | d;
    }
    *id = v;
    return 1;
}

/* Refuse file id at start: log why, rename it to <id>.tsi.damaged. */
static void refuse_file(tsd_datadir *dd, uint64_t id, const char *why)
{
    char from[DD_NAME_CAP], to[DD_NAME_CAP];
    dd_name(from, id, ".tsi");
    dd_name(to, id, ".tsi.damaged");
    dd->damaged++;
    if (renameat(dd->dirfd, from, dd->dirfd, to) == 0)
        tsd_log(TSD_LOG_ERROR, "--data-dir: refusing %s/%s: %s (renamed to %s; the others load)",
                dd->path, from, why, to);
    else
        tsd_log(TSD_LOG_ERROR,
                "--data-dir: refusing %s/%s: %s (and it cannot be renamed: %s; the others load)",
                dd->path, from, why, strerror(errno));
}

/*
 * Open, check and map the file of id. 0 with *out (a file item, one reference, committed);
 * 1 when the file was an upload that never completed (removed); -1 when it was refused (logged
 * and renamed); TS_ENOMEM when the process ran out of memory, mappings or descriptors (logged;
 * the file is left alone: it is not damaged, and the start fails).
 */
static int load_file(tsd_datadir *dd, uint64_t id, dd_file **out, uint8_t *name_out,
                     size_t *name_len)
{
    char name[DD_NAME_CAP], why[160];
    dd_name(name, id, ".tsi");
    int fd = openat(dd->dirfd, name, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOMEM)) {
        tsd_log(TSD_LOG_ERROR, "--data-dir %s: cannot open %s: %s", dd->path, name,
                strerror(errno));
        return TS_ENOMEM;
    }
    if (fd < 0) {
        snprintf(why, sizeof(why), "cannot open: %s", strerror(errno));
        goto refuse;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(why, sizeof(why), "not a regular file");
        goto refuse_fd;
    }
    uint64_t size = (uint64_t)st.st_size;
    uint8_t h[TSD_DATADIR_HDR];
    if (size < TSD_DATADIR_HDR) {
        snprintf(why, sizeof(why), "%llu bytes, shorter than its %d-byte header",
                 (unsigned long long)size, TSD_DATADIR_HDR);
        goto refuse_fd;
    }
    ssize_t got = pread(fd, h, sizeof(h), 0);
    if (got != (ssize_t)sizeof(h)) {
        snprintf(why, sizeof(why), "cannot read its header: %s",
                 got < 0 ? strerror(errno) : "short read");
        goto refuse_fd;
    }
    int all_zero = 1;
    for (size_t i = 0; i < sizeof(h) && all_zero; i++)
        all_zero = h[i] == 0;
    if (all_zero) {
        /* An upload cut off before it was stored: never acknowledged, so nothing is lost. */
        close(fd);
        (void)unlinkat(dd->dirfd, name, 0);
        tsd_log(TSD_LOG_INFO, "--data-dir %s: removed %s, an upload that never completed", dd->path,
                name);
        return 1;
    }
    if (memcmp(h, DD_MAGIC, 8) != 0) {
        snprintf(why, sizeof(why), "not a tensord data file (bad magic)");
        goto refuse_fd;
    }
    if (ts__get_u32le(h + DD_OFF_FORMAT) != TSD_DATADIR_FORMAT) {
        snprintf(why, sizeof(why), "format version %u (this tensord reads %d)",
                 ts__get_u32le(h + DD_OFF_FORMAT), TSD_DATADIR_FORMAT);
        goto refuse_fd;
    }
    if (ts__get_u64le(h + DD_OFF_SUM) != tsd_hash64(h, DD_OFF_SUM, DD_SUM_SEED)) {
        snprintf(why, sizeof(why), "header checksum mismatch");
        goto refuse_fd;
    }
    uint32_t flags = ts__get_u32le(h + DD_OFF_FLAGS);
    uint64_t hid = ts__get_u64le(h + DD_OFF_ID);
    uint64_t rec_len = ts__get_u64le(h + DD_OFF_RECLEN);
    uint64_t file_len = ts__get_u64le(h + DD_OFF_FILELEN);
    if ((flags & ~(uint32_t)DD_FLAGS_KNOWN) != 0) {
        snprintf(why, sizeof(why), "unknown flags 0x%x", flags);
        goto refuse_fd;
    }
    if (hid != id) {
        snprintf(why, sizeof(why), "its header names file %016llx", (unsigned long long)hid);
        goto refuse_fd;
    }
    if (file_len != size) {
        snprintf(why, sizeof(why), "%llu bytes, its header says %llu (truncated or extended)",
                 (unsigned long long)size, (unsigned long long)file_len);
        goto refuse_fd;
    }
    if (rec_len > file_len - TSD_DATADIR_HDR || rec_len < TS_REC_HDR_SIZE || file_len > SIZE_MAX) {
        snprintf(why, sizeof(why), "record length %llu does not fit the %llu-byte file",
                 (unsigned long long)rec_len, (unsigned long long)file_len);
        goto refuse_fd;
    }
    void *map = mmap(NULL, (size_t)file_len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED && errno == ENOMEM) {
        /* Out of address space or of mappings (vm.max_map_count): the file is not at fault. */
        tsd_log(TSD_LOG_ERROR,
                "--data-dir %s: cannot map %s (%llu bytes): %s (each item in a file is one "
                "mapping: see vm.max_map_count)",
                dd->path, name, (unsigned long long)file_len, strerror(errno));
        close(fd);
        return TS_ENOMEM;
    }
    if (map == MAP_FAILED) {
        snprintf(why, sizeof(why), "cannot map: %s", strerror(errno));
        goto refuse_fd;
    }
    close(fd);
    fd = -1;
    /* Reads headers and metadata only, never tensor data: pages of data stay on disk. */
    if (ts__record_validate((const uint8_t *)map + TSD_DATADIR_HDR, (size_t)rec_len, TS_MAX_DEPTH,
                            TS_MAX_NDIM, NULL) != 0) {
        (void)munmap(map, (size_t)file_len);
        snprintf(why, sizeof(why), "its %llu-byte record fails validation",
                 (unsigned long long)rec_len);
        goto refuse;
    }
    dd_file *f = ts__calloc(1, sizeof(*f));
    if (f == NULL) {
        (void)munmap(map, (size_t)file_len);
        return TS_ENOMEM;
    }
    f->dd = dd;
    f->id = id;
    f->seq = ts__get_u64le(h + DD_OFF_SEQ);
    f->map = map;
    f->map_len = (size_t)file_len;
    f->disk = disk_of(file_len);
    f->flags = flags;
    f->committed = 1;
    file_item_init(f, rec_len);
    *name_len = h[DD_OFF_NAMELEN];
    memcpy(name_out, h + DD_OFF_NAME, *name_len);
    *out = f;
    return 0;

refuse_fd:
    close(fd);
refuse:
    refuse_file(dd, id, why);
    return -1;
}

/* One file found at start, before the bins are rebuilt. */
typedef struct dd_found {
    dd_file *f;
    uint8_t name_len;
    uint8_t name[TS_MAX_NAME_LEN];
} dd_found;

/* Oldest first: sequence numbers, then ids (two commits never share one, but be total). */
static int found_cmp(const void *a, const void *b)
{
    const dd_found *x = a, *y = b;
    if (x->f->seq != y->f->seq)
        return x->f->seq < y->f->seq ? -1 : 1;
    return (x->f->id > y->f->id) - (x->f->id < y->f->id);
}

/*
 * Scan DIR: remove dropped and never-completed files, load and check the rest into *found
 * (oldest first). 0 or TS_ENOMEM (with what was loaded released).
 */
static int scan(tsd_datadir *dd, dd_found **found, size_t *n_found)
{
    int dfd = dup(dd->dirfd);
    DIR *d = dfd >= 0 ? fdopendir(dfd) : NULL;
    if (d == NULL) {
        if (dfd >= 0)
            close(dfd);
        tsd_log(TSD_LOG_ERROR, "--data-dir %s: cannot list it: %s", dd->path, strerror(errno));
        return TS_ESERVER;
    }
    dd_found *arr = NULL;
    size_t n = 0, cap = 0;
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        uint64_t id;
        if (parse_name(e->d_name, ".gone", &id)) {
            /* Let go of before the last run ended: it must not come back. */
            (void)unlinkat(dd->dirfd, e->d_name, 0);
            if (id >= dd->next_id)
                dd->next_id = id + 1;
            continue;
        }
        if (parse_name(e->d_name, ".tsi.damaged", &id)) {
            if (id >= dd->next_id)
                dd->next_id = id + 1;
            continue;
        }
        if (!parse_name(e->d_name, ".tsi", &id))
            continue;
        if (id >= dd->next_id)
            dd->next_id = id + 1;
        if (n == cap) {
            size_t nc = cap == 0 ? 64 : cap * 2;
            dd_found *na = ts__realloc(arr, nc * sizeof(*na));
            if (na == NULL) {
                rc = TS_ENOMEM;
                break;
            }
            arr = na;
            cap = nc;
        }
        size_t nl = 0;
        int lr = load_file(dd, id, &arr[n].f, arr[n].name, &nl);
        if (lr == TS_ENOMEM) {
            rc = lr;
            break;
        }
        if (lr != 0)
            continue;
        arr[n].name_len = (uint8_t)nl;
        dd->disk_bytes += arr[n].f->disk;
        dd->files++;
        dd->live++;
        n++;
    }
    closedir(d);
    if (rc != 0) {
        /* Nothing is stored yet: release without dropping (the files stay for the next try). */
        for (size_t i = 0; i < n; i++)
            tsd_item_unref(&arr[i].f->own.it);
        ts__free(arr);
        return rc;
    }
    if (n > 1)
        qsort(arr, n, sizeof(*arr), found_cmp);
    *found = arr;
    *n_found = n;
    return 0;
}

/* Rebuild the bins from found (oldest first), taking over each item's reference. */
static int rebuild(tsd_server *srv, tsd_datadir *dd, dd_found *found, size_t n)
{
    tsd_store *s = &srv->store;
    for (size_t i = 0; i < n; i++) {
        dd_file *f = found[i].f;
        tsd_item *it = &f->own.it;
        if (f->seq > dd->last_seq)
            dd->last_seq = f->seq;
        int replace = (f->flags & TSD_DATADIR_REPLACE) != 0;
        /*
         * A PUT replaced the bin's content: the older items' files were renamed when it was
         * stored, unless the machine went down before that rename reached the disk. Either way
         * they are not part of the bin.
         */
        tsd_bin *b = tsd_store_find(s, found[i].name, found[i].name_len);
        if (replace && b != NULL)
            for (tsd_item *old = b->head; old != NULL; old = old->next)
                tsd_datadir_drop(NULL, old);
        if (tsd_store_add(s, found[i].name, found[i].name_len, it, replace, f->seq) == NULL) {
            for (size_t k = i; k < n; k++)
                tsd_item_unref(&found[k].f->own.it);
            return TS_ENOMEM;
        }
        dd->loaded++;
    }
    if (dd->last_seq > srv->version)
        srv->version = dd->last_seq;
    return 0;
}

/* Make DIR (0700) when missing and check it is a directory. 0, or -1 with err. */
static int make_dir(const char *path, char *err, size_t cap)
{
    if (mkdir(path, 0700) != 0 && errno != EEXIST) {
        snprintf(err, cap, "--data-dir %s: cannot create it: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISDIR(st.st_mode)) {
        snprintf(err, cap, "--data-dir %s: not a directory", path);
        return -1;
    }
    if ((st.st_mode & 077) != 0)
        tsd_log(TSD_LOG_WARN, "--data-dir %s can be read by other users (chmod 700 it)", path);
    return 0;
}

/* The default --max-disk: what the files hold now plus 3/4 of the free space. */
static uint64_t default_max_disk(const tsd_datadir *dd)
{
    struct statvfs sv;
    if (fstatvfs(dd->dirfd, &sv) != 0)
        return 0;
    uint64_t free_b = (uint64_t)sv.f_bavail * (uint64_t)sv.f_frsize;
    uint64_t lim = free_b / DD_DEFAULT_FREE_DEN * DD_DEFAULT_FREE_NUM + dd->disk_bytes;
    return lim == 0 ? 1 : lim;
}

int tsd_datadir_start(tsd_server *srv)
{
    const tsd_config *cfg = &srv->cfg;
    char err[1024];
    if (cfg->data_dir == NULL)
        return 0;
    if (make_dir(cfg->data_dir, err, sizeof(err)) != 0)
        goto usage;
    tsd_datadir *dd = ts__calloc(1, sizeof(*dd));
    if (dd == NULL)
        return TS_ENOMEM;
    dd->dirfd = dd->lock_fd = -1;
    dd->next_id = 1;
    dd->data_min = cfg->data_min;
    size_t pl = strlen(cfg->data_dir);
    dd->path = ts__malloc(pl + 1);
    if (dd->path == NULL) {
        ts__free(dd);
        return TS_ENOMEM;
    }
    memcpy(dd->path, cfg->data_dir, pl + 1);
    srv->datadir = dd;
    dd->dirfd = open(cfg->data_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dd->dirfd < 0) {
        snprintf(err, sizeof(err), "--data-dir %s: cannot open it: %s", cfg->data_dir,
                 strerror(errno));
        goto usage;
    }
    dd->lock_fd = openat(dd->dirfd, "LOCK", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (dd->lock_fd < 0) {
        snprintf(err, sizeof(err), "--data-dir %s: cannot open %s/LOCK: %s", cfg->data_dir,
                 cfg->data_dir, strerror(errno));
        goto usage;
    }
    if (flock(dd->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        snprintf(err, sizeof(err), "--data-dir %s: %s", cfg->data_dir,
                 errno == EWOULDBLOCK ? "another tensord is using it (LOCK is held)"
                                      : strerror(errno));
        goto usage;
    }
    dd_found *found = NULL;
    size_t n = 0;
    int rc = scan(dd, &found, &n);
    if (rc == 0)
        rc = rebuild(srv, dd, found, n);
    ts__free(found);
    if (rc != 0) {
        tsd_log(TSD_LOG_ERROR, "--data-dir %s: loading failed: %s", cfg->data_dir, ts_strerror(rc));
        return rc;
    }
    dd->max_disk = cfg->max_disk == TSD_MAX_DISK_DEFAULT ? default_max_disk(dd) : cfg->max_disk;
    tsd_log(TSD_LOG_INFO,
            "--data-dir %s: loaded %llu items (%llu bytes of files, %llu refused as damaged); "
            "--max-disk %llu%s",
            cfg->data_dir, (unsigned long long)dd->loaded, (unsigned long long)dd->disk_bytes,
            (unsigned long long)dd->damaged, (unsigned long long)dd->max_disk,
            dd->max_disk == 0 ? " (unlimited)" : "");
    if (dd->max_disk != 0 && dd->disk_bytes > dd->max_disk)
        tsd_log(TSD_LOG_WARN,
                "--data-dir %s holds more than --max-disk: writes into files are "
                "refused until items are removed",
                cfg->data_dir);
    return 0;

usage:
    tsd_log(TSD_LOG_ERROR, "%s", err);
    srv->exit_code = TSD_EXIT_USAGE;
    return UV_EINVAL;
}

void tsd_datadir_free(tsd_server *srv)
{
    tsd_datadir *dd = srv->datadir;
    if (dd == NULL)
        return;
    srv->datadir = NULL;
    dd->closing = 1;
    if (dd->live == 0)
        dd_destroy(dd);
}
