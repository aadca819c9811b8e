/*
 * Shared memory: items whose record lives in a memfd, so that a client on the same host can map
 * it (GET_REF hands out the descriptor) instead of receiving a copy, and items made from a
 * client's sealed memfd (PUT_FD), stored without a copy. Loop thread only; the state is the
 * process's, like the buffer pool of store.c, because the last reference of an item is dropped
 * where no server is at hand.
 *
 * A server memfd is written through its read-write mapping (an upload lands there directly).
 * When its descriptor is first handed out it is sealed with TSD_SHM_SEALS: its size is fixed and
 * nobody can gain write access any more, while the server's own mapping stays (a tensor bin is
 * written in place through it). A memfd never handed out can be reused for the next upload of
 * the same size; one handed out never is (clients may still map it).
 */
#define _GNU_SOURCE
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define TSD_SHM_PAGE     ((size_t)4096)      /* bytes; memfd sizes are multiples of this */
#define TSD_SHM_MAX_FILE ((uint64_t)1 << 46) /* bytes; a client memfd larger is refused */

static struct {
    tsd_server *srv;
    uint64_t shm_min;  /* 0: no server memfds */
    uint64_t budget;   /* descriptors items and the pool may hold */
    uint64_t fds_used; /* held by items and by the pool */
    tsd_shm_stats st;
    long fake_full; /* testing aid: descriptor sends still to be answered "socket full" */
    struct {
        int fd;
        uint8_t *map;
        size_t len;
    } pool[TSD_SHM_POOL_MAX_BUFS];
    size_t pool_n;
    uint64_t pool_bytes;
} shm;

void tsd_shm_init(tsd_server *srv)
{
    shm.srv = srv;
    shm.shm_min = srv->cfg.shm_min;
    /* main.c raised the soft limit to the hard one already; size the budget from what it is. */
    struct rlimit rl;
    uint64_t lim = 1024;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        lim = rl.rlim_cur == RLIM_INFINITY ? ((uint64_t)1 << 20) : (uint64_t)rl.rlim_cur;
    uint64_t keep = (uint64_t)srv->cfg.max_clients + srv->cfg.max_unauth + TSD_FD_RESERVE;
    shm.budget = lim > keep ? lim - keep : 0;
    shm.st.fds_budget = shm.budget;
    /*
     * Testing aid: TSD_FAKE_FD_FULL=N makes every other send of a descriptor frame (N of them)
     * find the socket full, so tests can check the retry path (it needs a reader stopped at an
     * exact byte otherwise).
     */
    const char *ff = getenv("TSD_FAKE_FD_FULL");
    if (ff != NULL && ff[0] != '\0') {
        char *end;
        long n = strtol(ff, &end, 10);
        if (*end == '\0' && n > 0) {
            shm.fake_full = n;
            tsd_log(TSD_LOG_WARN,
                    "TSD_FAKE_FD_FULL=%ld: descriptor sends will meet a full socket "
                    "%ld times (a testing aid)",
                    n, n);
        }
    }
    if (shm.shm_min != 0 && shm.budget == 0)
        tsd_log(TSD_LOG_WARN,
                "the file descriptor limit (%llu) leaves no room for memfd items past "
                "--max-clients + --max-unauth-clients + %u: every item stays on the heap",
                (unsigned long long)lim, TSD_FD_RESERVE);
}

tsd_item_own *tsd_item_own_new(void)
{
    tsd_item_own *own = ts__calloc(1, sizeof(*own));
    if (own == NULL)
        return NULL;
    own->it.slot = TSD_ITEM_OWN;
    own->it.next = NULL;
    own->fd = -1;
    own->backing = TSD_BACK_HEAP;
    atomic_init(&own->it.refs, 1);
    return own;
}

/* The memfd size for a record of len bytes: as the heap pool rounds, so sizes recur. */
static size_t memfd_size(size_t len)
{
    if (len >= TSD_POOL_MIN)
        return ts__align_up(len, TSD_POOL_ROUND);
    return ts__align_up(len, TSD_SHM_PAGE);
}

static void pool_drop(size_t i)
{
    tsd_reclaim_unmap(shm.pool[i].map, shm.pool[i].len, shm.pool[i].fd);
    shm.pool_bytes -= shm.pool[i].len;
    shm.fds_used--;
    shm.pool_n--;
    /* Keep the order: the oldest entry is dropped first when room is needed. */
    memmove(&shm.pool[i], &shm.pool[i + 1], (shm.pool_n - i) * sizeof(shm.pool[0]));
}

/* A memfd of size bytes mapped read-write, fresh (zero) or recycled. 0 or -1. */
static int memfd_get(size_t size, int zero, int *fd_out, uint8_t **map_out)
{
    if (!zero) {
        for (size_t i = shm.pool_n; i-- > 0;) {
            if (shm.pool[i].len != size)
                continue;
            *fd_out = shm.pool[i].fd;
            *map_out = shm.pool[i].map;
            shm.pool_bytes -= size;
            shm.pool_n--;
            memmove(&shm.pool[i], &shm.pool[i + 1], (shm.pool_n - i) * sizeof(shm.pool[0]));
            return 0;
        }
    }
    /* A new descriptor: make room in the budget by closing pooled ones first. */
    while (shm.fds_used >= shm.budget && shm.pool_n > 0)
        pool_drop(0);
    if (shm.fds_used >= shm.budget)
        return -1;
    int fd = memfd_create("tensord-item", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return -1;
    if (ftruncate(fd, (off_t)size) != 0) {
        (void)close(fd);
        return -1;
    }
    void *map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED) {
        (void)close(fd);
        return -1;
    }
#ifdef MADV_HUGEPAGE
    /* Large records in huge pages where tmpfs allows them (shmem_enabled=advise). */
    if (size >= TSD_POOL_MIN)
        (void)madvise(map, size, MADV_HUGEPAGE);
#endif
    shm.fds_used++;
    *fd_out = fd;
    *map_out = map;
    return 0;
}

static tsd_item *memfd_item(size_t len, int zero)
{
    if (len == 0 || len > SIZE_MAX - TSD_POOL_ROUND)
        return NULL;
    tsd_item_own *own = tsd_item_own_new();
    if (own == NULL)
        return NULL;
    size_t size = memfd_size(len);
    if (memfd_get(size, zero, &own->fd, &own->data) != 0) {
        ts__free(own);
        return NULL;
    }
    own->len = len;
    own->alloc_len = size;
    own->backing = TSD_BACK_MEMFD;
    own->file_off = 0;
    own->file_len = size;
    own->counted = 1;
    shm.st.items++;
    shm.st.bytes += size;
    shm.st.fds_held++;
    return &own->it;
}

tsd_item *tsd_shm_item_new(tsd_server *srv, size_t len)
{
    (void)srv;
    if (shm.budget == 0)
        return NULL;
    return memfd_item(len, 0);
}

tsd_item *tsd_shm_item_new_zero(tsd_server *srv, size_t len)
{
    (void)srv;
    if (shm.budget == 0)
        return NULL;
    return memfd_item(len, 1);
}

tsd_item *tsd_shm_upload_item(tsd_server *srv, size_t len)
{
    (void)srv;
    if (shm.shm_min == 0 || len < shm.shm_min || shm.budget == 0)
        return NULL;
    return memfd_item(len, 0);
}

/*
 * Before a memfd's first hand-out: zero what follows the record (a recycled memfd may hold an
 * older record's bytes there, which the client could otherwise map) and seal it. 0 or -1.
 */
static int memfd_seal(tsd_item_own *own)
{
    size_t rec_end = ts__align_up(own->len, TSD_SHM_PAGE);
    if (rec_end > own->len)
        memset(own->data + own->len, 0, rec_end - own->len);
    if (own->alloc_len > rec_end &&
        fallocate(own->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)rec_end,
                  (off_t)(own->alloc_len - rec_end)) != 0)
        memset(own->data + rec_end, 0, own->alloc_len - rec_end);
    if (fcntl(own->fd, F_ADD_SEALS, TSD_SHM_SEALS) != 0) {
        tsd_log(TSD_LOG_WARN, "cannot seal a memfd (%s): the item goes inline", strerror(errno));
        return -1;
    }
    return 0;
}

int tsd_shm_ref(tsd_item *it, int *fd, int *owned, uint64_t *off, uint64_t *file_len)
{
    tsd_item_own *own = tsd_item_as_own(it);
    if (own == NULL)
        return 0;
    switch (own->backing) {
    case TSD_BACK_MEMFD:
        if (own->fd < 0)
            return 0;
        if (!own->handed) {
            if (memfd_seal(own) != 0)
                return 0;
            own->handed = 1;
        }
        *fd = own->fd;
        *owned = 0;
        *off = 0;
        *file_len = own->file_len;
        return 1;
    case TSD_BACK_CLIENT:
        if (own->fd < 0)
            return 0;
        own->handed = 1;
        *fd = own->fd;
        *owned = 0;
        *off = 0;
        *file_len = own->file_len;
        return 1;
    case TSD_BACK_FILE: {
        if (shm.srv == NULL)
            return 0;
        int f = tsd_datadir_open_ro(shm.srv, it);
        if (f < 0)
            return 0;
        own->handed = 1;
        *fd = f;
        *owned = 1;
        *off = own->file_off;
        *file_len = own->file_len;
        return 1;
    }
    default:
        return 0;
    }
}

int tsd_shm_adopt(tsd_server *srv, int fd, uint64_t rec_len, tsd_item **out)
{
    (void)srv;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0)
        return -EINVAL; /* not a memfd (or a file system without seals) */
    int want = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL;
    if ((seals & want) != want) {
        if (seals & F_SEAL_SEAL)
            return -EINVAL; /* sealed against sealing without the seals we need */
        if (fcntl(fd, F_ADD_SEALS, want & ~seals) != 0)
            return errno == EBUSY ? -EBUSY : -EINVAL;
    }
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode))
        return -EINVAL;
    uint64_t size = (uint64_t)sb.st_size;
    if (rec_len == 0 || rec_len > size)
        return -ERANGE;
    if (size > TSD_SHM_MAX_FILE)
        return -EFBIG;
    size_t map_len = ts__align_up((size_t)size, TSD_SHM_PAGE);
    void *map = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, 0);
    if (map == MAP_FAILED && errno == EPERM)
        map = mmap(NULL, map_len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (map == MAP_FAILED)
        return errno == ENOMEM ? TS_ENOMEM : -EINVAL;
    tsd_item_own *own = tsd_item_own_new();
    if (own == NULL) {
        (void)munmap(map, map_len);
        return TS_ENOMEM;
    }
    own->data = map;
    own->len = (size_t)rec_len;
    own->alloc_len = map_len;
    own->backing = TSD_BACK_CLIENT;
    own->file_off = 0;
    own->file_len = size;
    /* Keep the descriptor for GET_REF while the budget allows; the mapping alone suffices. */
    if (shm.fds_used < shm.budget) {
        own->fd = fd;
        own->counted = 1;
        shm.fds_used++;
        shm.st.fds_held++;
    } else {
        (void)close(fd);
    }
    shm.st.items++;
    shm.st.bytes += map_len;
    shm.st.puts_fd++;
    *out = &own->it;
    return 0;
}

/* Keep a memfd never handed out for the next upload of its size; 1 when kept. */
static int pool_keep(tsd_item_own *own)
{
    if (own->handed || own->live || own->alloc_len > TSD_SHM_POOL_MAX_BYTES)
        return 0;
    while (shm.pool_n > 0 && (shm.pool_n == TSD_SHM_POOL_MAX_BUFS ||
                              shm.pool_bytes + own->alloc_len > TSD_SHM_POOL_MAX_BYTES))
        pool_drop(0);
    shm.pool[shm.pool_n].fd = own->fd;
    shm.pool[shm.pool_n].map = own->data;
    shm.pool[shm.pool_n].len = own->alloc_len;
    shm.pool_n++;
    shm.pool_bytes += own->alloc_len;
    return 1;
}

void tsd_shm_release(tsd_item_own *own)
{
    switch (own->backing) {
    case TSD_BACK_MEMFD:
    case TSD_BACK_CLIENT:
        shm.st.items--;
        shm.st.bytes -= own->alloc_len;
        if (own->counted)
            shm.st.fds_held--;
        if (own->backing == TSD_BACK_MEMFD && own->fd >= 0 && pool_keep(own))
            break; /* the descriptor stays counted in fds_used, now the pool's */
        /* The kernel's time to take the pages back is the reclaim thread's (reclaim.c). */
        tsd_reclaim_unmap(own->data, own->alloc_len, own->fd);
        if (own->counted)
            shm.fds_used--;
        break;
    case TSD_BACK_FILE:
        tsd_datadir_release(own); /* unmaps and frees own */
        return;
    default:
        break;
    }
    ts__free(own);
}

int tsd_shm_fake_full(void)
{
    /* Every other try: a frame's first try fails and its retry goes through. */
    static int flip;
    if (shm.fake_full <= 0 || (flip ^= 1) == 0)
        return 0;
    shm.fake_full--;
    return 1;
}

void tsd_shm_stats_get(tsd_shm_stats *st)
{
    *st = shm.st;
    st->pool_bytes = shm.pool_bytes;
}

void tsd_shm_count_sent(uint64_t n)
{
    shm.st.fds_sent += n;
}

void tsd_shm_count_pending(int delta, int received)
{
    if (delta > 0) {
        shm.st.fds_pending += (uint64_t)delta;
        if (received)
            shm.st.fds_received += (uint64_t)delta;
    } else {
        shm.st.fds_pending -= (uint64_t)(-delta);
    }
}

void tsd_shm_drain(void)
{
    while (shm.pool_n > 0)
        pool_drop(shm.pool_n - 1);
}
