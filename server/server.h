/*
 * tensord's one internal header (names use the tsd_ prefix). The daemon is a single libuv loop
 * thread that owns every socket, connection, bin and item; nothing here is thread-safe, and
 * nothing needs to be. Files:
 *   main.c    flags, defaults, start-up and exit
 *   server.c  listeners (TCP, unix), accept, signals, the periodic cron, shutdown
 *   conn.c    one connection: accept, the read state machine, header limits, uploads, close
 *   output.c  a connection's output queue: write batches, replies, the slow-reader cut-off
 *   ops.c     the request handlers (one per opcode)
 *   rows.c    tensor bins and row access (TENSOR_BIN, READ_ROWS, GATHER_ROWS, WRITE_ROWS)
 *   stream.c  streams: logs with server-kept cursors, retention, back-pressure (stream.h)
 *   table.c   replay tables: samplers, removers, a rate limiter that waits (table.h)
 *   heap.h    the sift steps of the index-tracking min-heaps of deadline.c and table.c
 *   deadline.c  the waits stream.c and table.c park: their limits, deadline heap and timer
 *   ps.c      the parameter server: optimizer steps off the loop, embedding tables (ps.h)
 *   service.c services: calls forwarded to registered connections, answers routed back
 *   store.c   bins, items, the name hash table, memory accounting, point-in-time passes
 *   view.c    views: passes over the store walked a chunk of bins per loop turn (LIST, SAVE)
 *   slab.c    size classes for the buffers of small records
 *   reclaim.c large mappings and buffers given back to the kernel on a thread of their own
 *   notify.c  listeners (subscriptions) and waiters
 *   stats.c   counters and the STATS reply
 *   shard.c   sharding: --shard and --cluster-map, the slot check, WRONG_SHARD and SHARD_MAP
 *   http.c    health and Prometheus metrics over HTTP on a listener of their own (http.h)
 *   metrics.c the metrics page: the counters above in Prometheus text format (http.h)
 *   snapshot.c  snapshots: the jobs (SAVE, the timer, writing off the loop), loading at start
 *   snapfile.c  the snapshot file format: checksum, writer, reader (no loop; snapfile.h)
 */
#ifndef TSD_SERVER_H
#define TSD_SERVER_H

#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include <uv.h>

#include "common.h"
#include "msg.h"
#include "proto.h"

/* ---------------------------------------------------------------------------------------------
 * Limits and defaults
 */
#define TSD_DEFAULT_PORT        8000
#define TSD_DEFAULT_HOST        "127.0.0.1"
#define TSD_DEFAULT_MAX_CLIENTS 10000u
#define TSD_DEFAULT_MAX_OUTPUT  ((uint64_t)256 << 20) /* bytes queued per connection, 256 MiB */
/*
 * Bytes; the per-connection input buffer. It holds headers, names and whole control bodies, so
 * it must exceed TS_HDR_SIZE + TS_MAX_CTRL_BODY (msg.h); item bodies bypass it entirely.
 */
#define TSD_IBUF_SIZE   (16 * 1024)
#define TSD_WRITE_CHUNK ((size_t)4 << 20)     /* bytes; largest single uv_buf of a reply */
#define TSD_MAX_WAIT_MS (24u * 3600u * 1000u) /* ms; WAIT timeouts are capped at 24 h */
/*
 * ms; a connection closed after an error reply is dropped at the latest after this long. It is
 * also the shutdown's grace: when tensord stops, every connection is told SHUTTING_DOWN and
 * those that have not read their last frames and closed within this long are closed.
 */
#define TSD_CLOSE_GRACE_MS 5000
/*
 * The message of SHUTTING_DOWN frames: short enough for an emergency frame (TSD_EMERG_MSG), so
 * that even without memory every waiting request and connection is told.
 */
#define TSD_SHUTDOWN_MSG "tensord is shutting down"
#define TSD_CRON_MS      500 /* ms; period of the housekeeping timer */
#define TSD_BATCH_CACHE  2   /* write batches kept per connection for reuse */
/* Bytes; per-connection soft output limit, held for TSD_DEFAULT_OUTPUT_SOFT_S seconds. */
#define TSD_DEFAULT_OUTPUT_SOFT   ((uint64_t)64 << 20)
#define TSD_DEFAULT_OUTPUT_SOFT_S 60u
/* Bytes of unwritten output above which a listener's notifications are coalesced per bin. */
#define TSD_DEFAULT_NOTIFY_BACKLOG ((uint64_t)1 << 20)
/*
 * Subscriptions plus pending WAITs per connection. Each costs a small allocation (a WAIT also a
 * timer) that lives until it ends or the connection closes, so without a cap one client could
 * grow the daemon's memory without bound, one request at a time.
 */
#define TSD_DEFAULT_MAX_WATCH 65536u
#define TSD_DEFAULT_HELLO_MS  10000u /* ms; a connection must complete HELLO within this */
/*
 * s; a frame whose header or body stops arriving for this long is cut (the connection closes
 * and its upload reservation is returned), so a stalled upload cannot hold memory forever.
 */
#define TSD_DEFAULT_BODY_TIMEOUT_S 30u
/*
 * Connections that have not completed HELLO. They are counted apart from --max-clients, so a
 * flood of unauthenticated connections cannot take the places of authenticated clients.
 */
#define TSD_DEFAULT_MAX_UNAUTH 1024u
/*
 * Bytes an upload reserves against --max-memory ahead of what has arrived. An upload reserves as
 * its body arrives, so a client that declares a huge body and stalls holds at most this beyond
 * the bytes it really sent (its buffer is virtual memory until written).
 */
#define TSD_UPLOAD_STEP ((uint64_t)4 << 20)
/*
 * Bytes an upload reserves when its header is in, before any body byte; each later step doubles
 * up to TSD_UPLOAD_STEP as bytes arrive. A client that sends a header and then trickles its body
 * holds only this much, so trickling connections cannot take the whole limit in 4 MiB pieces.
 */
#define TSD_UPLOAD_FIRST ((uint64_t)64 << 10)
/*
 * Divisor of --max-memory: uploads in progress may reserve at most max_memory / this in all. A new
 * upload's header past it is answered OUT_OF_MEMORY, so unfinished uploads cannot lock out
 * writers whose items would fit.
 */
#define TSD_UPLOAD_SHARE_DIV 2u
/*
 * Bytes; records (or compressed bodies inflating to) at least this large are decompressed and
 * validated on the thread pool, so one big request does not stall every other client (inline,
 * this much costs the loop a few milliseconds at most; the hand-off costs tens of microseconds,
 * small beside receiving this many bytes). Above TSD_SLAB_MAX, so only items with a buffer of
 * their own ever leave the loop thread.
 */
#define TSD_OFFLOOP_MIN           ((size_t)4 << 20)
#define TSD_DEFAULT_SAVE_INTERVAL 60u  /* s; period of snapshots with --save */
#define TSD_ACCEPT_PAUSE_MS       1000 /* ms; accepting pauses this long when out of fds */
#define TSD_RETRY_MS              50   /* ms; retry after an allocation failure */
/* Frames that must go out even when memory is exhausted (see tsd_emerg). */
#define TSD_EMERG_FRAMES 4
#define TSD_EMERG_MSG    64 /* bytes of body in an emergency frame */
/* Process exit codes besides 0 (clean) and 1 (failure while running). */
#define TSD_EXIT_USAGE    2 /* bad flags or an unsafe configuration */
#define TSD_EXIT_SNAPSHOT 3 /* the snapshot named by --save exists but cannot be loaded */

_Static_assert(TSD_IBUF_SIZE > TS_HDR_SIZE + TS_MAX_CTRL_BODY, "control frames fit the buffer");
_Static_assert(TSD_IBUF_SIZE > TS_HDR_SIZE + TS_MAX_PREAUTH_BODY, "HELLO fits the buffer");

enum { TSD_LOG_ERROR = 0, TSD_LOG_WARN = 1, TSD_LOG_INFO = 2, TSD_LOG_DEBUG = 3 };

typedef struct tsd_config {
    const char *host;          /* TCP address to bind */
    int port;                  /* 0 = ephemeral */
    const char *unix_path;     /* also listen here when not NULL */
    const char *port_file;     /* write the bound TCP port here when not NULL */
    uint64_t max_frame;        /* bytes; request body limit */
    uint64_t max_memory;       /* bytes of items held; 0 = unlimited */
    uint64_t max_output;       /* bytes queued per connection before it is cut off */
    uint32_t max_clients;      /* connections; more are refused with TOO_MANY_CLIENTS */
    int log_level;             /* TSD_LOG_* */
    const uint8_t *auth_token; /* the shared secret; NULL: no authentication */
    size_t auth_token_len;
    int insecure;                  /* allow a non-loopback --host without a token */
    uint64_t output_soft;          /* bytes; 0 = no soft output limit */
    uint32_t output_soft_seconds;  /* how long output may stay over output_soft */
    uint64_t notify_backlog;       /* bytes of unwritten output before notifications coalesce */
    uint32_t hello_timeout_ms;     /* 0 = none */
    uint32_t max_watch;            /* subscriptions + pending WAITs per connection */
    const char *save_path;         /* snapshot file; NULL = no persistence */
    uint32_t save_interval_s;      /* 0 = snapshots only on SAVE and at shutdown */
    int stop_writes_on_save_error; /* refuse writes while snapshots fail (with save_path) */
    uint32_t body_timeout_s;       /* s without progress inside a frame; 0 = none */
    uint32_t max_unauth;           /* connections that have not completed HELLO */
    const char *data_dir;          /* --data-dir; NULL = items live in memory only */
    uint64_t data_min;             /* bytes; smaller items stay in memory with --data-dir */
    uint64_t max_disk;             /* bytes of --data-dir files; 0 = unlimited */
    uint64_t shm_min;              /* bytes; uploads this large land in a memfd; 0 = never */
    int no_fds;                    /* refuse HELLO FDS (no descriptors on unix sockets) */
    /*
     * Sharding (shard.c): the values of --shard and --cluster-map, the map made from them (NULL:
     * this daemon owns every slot and never answers WRONG_SHARD) and this daemon's index in it.
     */
    const char *shard_arg, *cluster_map_path;
    struct ts__shard_map *shard_map;
    uint16_t shard_self;
    /* Accept a token sent in clear (clients before 0.5.0 can send nothing else). */
    int allow_plain_token;
    /* TLS on TCP connections (tls.c): the files, and the context made from them; NULL = off. */
    const char *tls_cert, *tls_key, *tls_client_ca;
    struct ssl_ctx_st *tls_ctx;
    int http_port;              /* --http-port: health and metrics over HTTP; -1 = off */
    const char *http_host;      /* --http-host: address of that listener; NULL = host */
    const char *http_port_file; /* write the bound HTTP port here when not NULL */
} tsd_config;

/* Fill cfg with the defaults (max_memory: 3/4 of physical memory). */
void tsd_config_defaults(tsd_config *cfg);

/* Log a line to stderr when level <= the configured level. */
void tsd_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void tsd_log_set_level(int level);

/* ---------------------------------------------------------------------------------------------
 * Items and bins (store.c)
 *
 * An item is one record exactly as received: immutable after it is linked into a bin, shared
 * by reference between the bin and every write that sends it. The count is atomic so that
 * off-loop work (snapshots) can hold references too; the last reference is dropped on the
 * loop thread only.
 *
 * Small records (up to TSD_SLAB_MAX bytes) live in slabs (slab.c): the header is one entry of
 * its slab's header array and the record a slot of its slab's mapping. The header holds only
 * what cannot be computed: the record's address follows from the slot index and the slab (found
 * from the header's place in the array), and the length of a small record fits 16 bits. So an
 * item costs its record rounded up to 64 bytes plus this 16-byte header, with no allocation of
 * its own. Larger records have a buffer of their own (see the pool below) and a tsd_item_own,
 * which starts with the header. Use the accessors below for the record and its length.
 */
struct tsd_store;
typedef struct tsd_item {
    atomic_uint refs; /* the count, plus TSD_ITEM_ORPHANED once the store has let go of it */
    uint16_t slot;    /* index in its slab, or TSD_ITEM_OWN: a buffer of its own */
    uint16_t slen;    /* record length of a slab item (at most TSD_SLAB_MAX) */
    /*
     * An item is in at most one bin and, once unlinked, in none, so the pointer serves both: the
     * next item while linked, and the store whose orphaned_bytes count it while orphaned.
     */
    union {
        struct tsd_item *next;       /* the next (newer) item of its bin, while linked */
        struct tsd_store *orphan_of; /* while TSD_ITEM_ORPHANED is set */
    };
} tsd_item;

/*
 * The top bit of refs: the store dropped the item while other references (a queued reply, a
 * snapshot) still held it, so its bytes are counted in the store's orphaned_bytes until the last
 * reference goes. Counts never come near it (one reference per queued reply or snapshot).
 */
#define TSD_ITEM_ORPHANED 0x80000000u

#define TSD_ITEM_OWN UINT16_MAX

/*
 * Where the record of an item with a buffer of its own lives (tsd_item_own.backing). Heap and
 * server memfd buffers belong to store.c and shm.c; a client memfd (PUT_FD) is mapped read-only
 * by shm.c; a data-dir file belongs to datadir.c, which store.c tells when the item goes
 * (tsd_datadir_drop).
 */
enum {
    TSD_BACK_HEAP = 0, /* an anonymous buffer (the pool) */
    TSD_BACK_MEMFD,    /* a memfd the server made and maps read-write (uploads, tensor bins) */
    TSD_BACK_CLIENT,   /* a sealed memfd a client sent with PUT_FD, mapped read-only */
    TSD_BACK_FILE      /* a --data-dir file (datadir.c) */
};

/* An item with a buffer of its own (records over TSD_SLAB_MAX bytes, and every shared one). */
typedef struct tsd_item_own {
    tsd_item it;
    uint8_t *data;     /* record bytes; 64-byte aligned (page-aligned when in a file) */
    size_t len;        /* record length */
    size_t alloc_len;  /* heap: what buf_get returned, for buf_put; else the bytes mapped */
    uint8_t backing;   /* TSD_BACK_* */
    uint8_t handed;    /* its descriptor has been sent to a client (a memfd is sealed then) */
    uint8_t live;      /* a tensor bin's item: its bytes change in place (GET_REF flag LIVE) */
    uint8_t counted;   /* holds one of the fd budget's places (shm.c) */
    int fd;            /* memfd and client backings: the descriptor; -1 when none is held */
    uint64_t file_off; /* offset of the record in its file (0 in a memfd, 4096 in data-dir) */
    uint64_t file_len; /* bytes of the file a client may map (>= file_off + len) */
    void *ext;         /* datadir.c's own state of a file item */
} tsd_item_own;

/* The own item it (it->slot == TSD_ITEM_OWN), or NULL for a slab item. */
static inline tsd_item_own *tsd_item_as_own(tsd_item *it)
{
    return it->slot == TSD_ITEM_OWN ? (tsd_item_own *)(void *)it : NULL;
}

/*
 * One slab: nslots slots of size bytes at base (one mapping), and their item headers. Slots
 * below fresh have been handed out at least once; the free ones among them are chained through
 * their headers' next. Slots from fresh up have never been touched, so their pages cost nothing.
 * Only slab.c changes a slab; base and size are fixed for its life, so the accessors below may
 * read them from any thread that holds a reference to one of its items.
 */
typedef struct tsd_slab {
    struct tsd_slab *prev, *next; /* in its class's list of slabs with a free slot */
    uint8_t *base;
    tsd_item *free;
    uint32_t size;   /* bytes per slot */
    uint32_t nslots; /* a multiple of 64, so that nslots * size is a whole number of pages */
    uint32_t used;   /* slots holding a record */
    uint32_t fresh;  /* slots handed out at least once */
    uint32_t cls;
    tsd_item items[]; /* one header per slot */
} tsd_slab;

/* The slab whose header array holds it (a slab item). */
static inline tsd_slab *tsd_item_slab(const tsd_item *it)
{
    const tsd_item *first = it - it->slot;
    return (tsd_slab *)(void *)((const char *)first - offsetof(tsd_slab, items));
}

/* The record bytes: 64-byte aligned, at least tsd_item_len(it) of them. */
static inline uint8_t *tsd_item_data(const tsd_item *it)
{
    if (it->slot == TSD_ITEM_OWN)
        return ((const tsd_item_own *)(const void *)it)->data;
    const tsd_slab *s = tsd_item_slab(it);
    return s->base + (size_t)it->slot * s->size;
}

/* The record length. */
static inline size_t tsd_item_len(const tsd_item *it)
{
    if (it->slot == TSD_ITEM_OWN)
        return ((const tsd_item_own *)(const void *)it)->len;
    return it->slen;
}

/* Set the record length: at most the length the item was created with (see tsd_item_new_sized). */
static inline void tsd_item_set_len(tsd_item *it, size_t len)
{
    if (it->slot == TSD_ITEM_OWN)
        ((tsd_item_own *)(void *)it)->len = len;
    else
        it->slen = (uint16_t)len;
}

/* A new item with room for len record bytes and one reference; NULL on allocation failure. */
tsd_item *tsd_item_new(size_t len);
/*
 * The same, for a buffer of at least len bytes whose record may end up shorter (lz4 path): the
 * caller may lower len afterwards, never raise it.
 */
tsd_item *tsd_item_new_sized(size_t len);
void tsd_item_ref(tsd_item *it);
/* Drop a reference; the last one recycles the buffer (loop thread only: slabs and the pool). */
void tsd_item_unref(tsd_item *it);

/*
 * Slabs: size classes for small record buffers (slab.c). Loop thread only.
 *
 * Class k holds slots of 64 * (k + 1) bytes. A slab of a class is one anonymous mapping of 64 * m
 * slots (m chosen so the mapping has at least TSD_SLAB_MIN_MAP bytes), which is a whole number
 * of pages for every class, plus one allocation holding the slab's bookkeeping and the item
 * headers of its slots. Freed slots are reused first; a slab whose last slot is freed is unmapped,
 * except that up to TSD_SLAB_KEEP bytes of empty slabs are kept for the next items.
 */
#define TSD_SLAB_GRAIN   64                 /* bytes; slot sizes are multiples of this */
#define TSD_SLAB_MAX     ((size_t)32 << 10) /* bytes; larger records get their own buffer */
#define TSD_SLAB_CLASSES (TSD_SLAB_MAX / TSD_SLAB_GRAIN)
#define TSD_SLAB_MIN_MAP ((size_t)64 << 10)  /* bytes; smallest slot area of a slab */
#define TSD_SLAB_KEEP    ((uint64_t)2 << 20) /* bytes of empty slabs kept for reuse */

/* Slot indexes and lengths of slab items must fit the 16-bit fields of the header. */
_Static_assert(TSD_SLAB_MAX < UINT16_MAX, "slab record length must fit uint16_t");
_Static_assert(TSD_SLAB_MIN_MAP / TSD_SLAB_GRAIN + 64 < UINT16_MAX, "slot index must fit uint16_t");

/*
 * An item header for a free slot of at least len bytes (1..TSD_SLAB_MAX), with slot set and
 * next cleared, refs and the length left to the caller; NULL on allocation failure.
 */
tsd_item *tsd_slab_alloc(size_t len);
/* Return the slot of it (a header from tsd_slab_alloc) to its slab. */
void tsd_slab_free(tsd_item *it);
/* The slot size, in bytes, of the slab holding it. */
size_t tsd_slab_slot_size(const tsd_item *it);
/* Unmap the empty slabs kept for reuse (at exit; tests). */
void tsd_slab_drain(void);

typedef struct tsd_slab_stats {
    uint64_t slabs;      /* slabs in existence, empty ones included */
    uint64_t mapped;     /* bytes of slot areas mapped */
    uint64_t meta;       /* bytes of bookkeeping allocations (headers included) */
    uint64_t slots_used; /* slots holding a record */
    uint64_t empty_kept; /* bytes of slot areas of empty slabs kept for reuse */
} tsd_slab_stats;

void tsd_slab_stats_get(tsd_slab_stats *st);

#define TSD_POOL_MIN       ((size_t)4 << 20)     /* bytes; smaller buffers come from malloc */
#define TSD_POOL_ROUND     ((size_t)2 << 20)     /* bytes; large sizes round up to this */
#define TSD_POOL_MAX_BUFS  8                     /* buffers kept for reuse */
#define TSD_POOL_MAX_BYTES ((uint64_t)512 << 20) /* bytes kept for reuse, at most */
/* Free every pooled buffer and every empty slab kept for reuse (at exit). */
void tsd_pool_drain(void);
/* Bytes currently pooled. */
uint64_t tsd_pool_bytes(void);

/* ---------------------------------------------------------------------------------------------
 * Reclaim (reclaim.c): releases of at least TSD_RECLAIM_MIN bytes (unmapping, closing a memfd,
 * freeing a large buffer) go to one thread of their own, so that the kernel's time to take the
 * pages back is not the loop's. At most TSD_RECLAIM_MAX_PENDING bytes wait at a time; past it,
 * and without the thread, a release happens at once. Called on the loop thread.
 */
#define TSD_RECLAIM_MIN ((size_t)4 << 20) /* bytes; smaller releases happen at once */
#define TSD_RECLAIM_MAX_PENDING                                                                    \
    ((uint64_t)1 << 30)          /* bytes waiting, at most (plus one release)                      \
                                  */
#define TSD_RECLAIM_MAX_JOBS 64u /* releases waiting, at most (each may hold a descriptor) */

typedef struct tsd_reclaim_stats {
    uint64_t pending_bytes; /* handed to the thread and not yet released */
    uint64_t jobs;          /* since start: releases handed to the thread */
    uint64_t bytes;         /* since start: their bytes */
} tsd_reclaim_stats;

/*
 * Block SIGINT, SIGTERM and SIGHUP in the calling thread (*old: the mask before, to restore
 * with pthread_sigmask), so that a thread it starts meanwhile inherits the block and those
 * signals only ever reach the loop thread (server.c, pool_start, says why). server.c.
 */
void tsd_signals_block(sigset_t *old);
/* Start the thread (tsd_server_init); -1 when it cannot start (releases then happen at once). */
int tsd_reclaim_start(void);
/* Finish every queued release and end the thread (tsd_server_free). */
void tsd_reclaim_stop(void);
/* munmap(addr, len) when addr is not NULL, then close(fd) when fd >= 0. */
void tsd_reclaim_unmap(void *addr, size_t len, int fd);
/* ts__free_aligned(p, len). */
void tsd_reclaim_free_aligned(void *p, size_t len);
void tsd_reclaim_stats_get(tsd_reclaim_stats *st);

/* ---------------------------------------------------------------------------------------------
 * Shared memory (shm.c): items held in memfds, descriptors handed to clients (GET_REF) and taken
 * from them (PUT_FD). Loop thread only, like the pool; the state is the process's.
 */
typedef struct tsd_server tsd_server;
/* Bytes; uploads at least this large land in a memfd by default (--shm-min, 0 = never). */
#define TSD_DEFAULT_SHM_MIN ((uint64_t)1 << 20)
/*
 * Descriptors a connection may have received and not yet claimed by a frame: a client passes one
 * per PUT_FD, so a few cover any pipeline while a flood of strays cannot eat the fd table.
 */
#define TSD_MAX_PENDING_FDS 16u
/*
 * Descriptors kept out of the items' budget besides one per --max-clients connection: listeners,
 * the loop's own, snapshot files, data-dir files opened to be sent, log and standard streams,
 * and the memfds of releases waiting for the reclaim thread (at most TSD_RECLAIM_MAX_JOBS).
 */
#define TSD_FD_RESERVE 256u
/* Server memfds kept for reuse (never handed out), and their bytes at most. */
#define TSD_SHM_POOL_MAX_BUFS  8
#define TSD_SHM_POOL_MAX_BYTES ((uint64_t)512 << 20)
/* Seals of a memfd handed to a client: its size is fixed and nobody can write it any more
 * through a new mapping or write(2); the server's own writable mapping stays (tensor bins). */
#define TSD_SHM_SEALS (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL)

typedef struct tsd_shm_stats {
    uint64_t items;        /* items whose record is in a memfd or a client's memfd */
    uint64_t bytes;        /* bytes of their files (memfd sizes, page-rounded) */
    uint64_t fds_held;     /* descriptors held by items */
    uint64_t fds_budget;   /* at most this many (0: memfd items are off) */
    uint64_t fds_sent;     /* descriptors sent in GET_REF/PEEK_REF replies */
    uint64_t fds_received; /* descriptors received on unix connections */
    uint64_t fds_pending;  /* received and not yet claimed by a frame, all connections */
    uint64_t puts_fd;      /* PUT_FD/APPEND_FD stored */
    uint64_t pool_bytes;   /* bytes of memfds kept for reuse */
} tsd_shm_stats;

/*
 * At start: remember the server (for data-dir items), raise RLIMIT_NOFILE's soft limit to its
 * hard limit and size the fd budget (the limit less --max-clients less TSD_FD_RESERVE).
 */
void tsd_shm_init(tsd_server *srv);
/*
 * A new item of len record bytes (len >= 1) in a fresh or recycled memfd mapped read-write,
 * one reference, or NULL: memfd items are off (--shm-min 0), the fd budget is spent, or a
 * system call failed (the caller then uses the heap). The record is at offset 0 of the file;
 * the bytes are zero only when the memfd is fresh (tsd_shm_item_new_zero for zeroed ones).
 * Loop thread only. Tensor bins (rows.c) write into tsd_item_data() for the item's life: the
 * descriptor handed out is sealed with TSD_SHM_SEALS, which leaves that mapping writable.
 */
tsd_item *tsd_shm_item_new(tsd_server *srv, size_t len);
/* The same, zero-filled (never recycled: a fresh memfd reads as zeros). */
tsd_item *tsd_shm_item_new_zero(tsd_server *srv, size_t len);
/* An upload of len bytes: a memfd item when len >= --shm-min (and memfds are on), else NULL. */
tsd_item *tsd_shm_upload_item(tsd_server *srv, size_t len);
/*
 * How it goes in a GET_REF reply: 1 by descriptor (*fd to send; *owned: the caller closes it
 * once sent; *off and *file_len as the entry says), 0 inline. A memfd is sealed the first time
 * it is handed out. Never fails: an item that cannot be sent by descriptor goes inline.
 */
int tsd_shm_ref(tsd_item *it, int *fd, int *owned, uint64_t *off, uint64_t *file_len);
/*
 * Take a client's memfd for PUT_FD: seal it (F_SEAL_SHRINK|GROW|WRITE|SEAL), check it holds
 * rec_len bytes, map it read-only. 0 and *out (one reference; its alloc_len is the file size
 * rounded up to pages, what it counts against --max-memory); fd is taken then (kept for GET_REF,
 * or closed when the fd budget is spent). On failure fd stays the caller's: -EBUSY when it is
 * still mapped writable somewhere; -EINVAL when it is not a memfd that can be sealed; -ERANGE
 * when rec_len is 0 or past its end; -EFBIG when the file is larger than 2^46 bytes; TS_ENOMEM.
 */
int tsd_shm_adopt(tsd_server *srv, int fd, uint64_t rec_len, tsd_item **out);
/* Release the backing of an own item that is not on the heap (last reference; store.c). */
void tsd_shm_release(tsd_item_own *own);
/* A zeroed own-item struct with one reference, backing heap, fd -1 (datadir.c fills it). */
tsd_item_own *tsd_item_own_new(void);
void tsd_shm_stats_get(tsd_shm_stats *st);
/* Count descriptors sent, and received descriptors pending (+1 / -1) across connections. */
void tsd_shm_count_sent(uint64_t n);
void tsd_shm_count_pending(int delta, int received);
/* Close the recycled memfds (at exit). */
void tsd_shm_drain(void);
/* Testing aid (TSD_FAKE_FD_FULL): 1 when this send must act as if the socket were full. */
int tsd_shm_fake_full(void);

/* ---------------------------------------------------------------------------------------------
 * The data directory (datadir.c): items in memory-mapped files DIR/<id>.tsi (--data-dir), which
 * survive restarts and count against --max-disk instead of --max-memory. Loop thread only.
 */
#define TSD_DATADIR_HDR     4096  /* bytes; the file header, then the record (page-aligned) */
#define TSD_DATADIR_FORMAT  1     /* the header's format version; start-up reads only this one */
#define TSD_DATADIR_TENSOR  0x01u /* commit flag: the item of a tensor bin (restored as one) */
#define TSD_DATADIR_REPLACE 0x02u /* commit flag: it replaced its bin's content (PUT, PUT_FD) */
/* cfg.max_disk: 3/4 of the file system's free space at start plus what the files hold. */
#define TSD_MAX_DISK_DEFAULT UINT64_MAX
typedef struct tsd_server tsd_server;
typedef struct tsd_datadir tsd_datadir;
/*
 * At start (tsd_server_init, store ready): create DIR (0700) when missing, lock DIR/LOCK, load
 * every file (a damaged one is logged, renamed to <id>.tsi.damaged and skipped) and rebuild the
 * bins in sequence order (bin version = its newest item's sequence number; the change counter
 * continues above them). 0; else srv->exit_code says how to exit (TSD_EXIT_USAGE: unusable or
 * locked directory).
 */
int tsd_datadir_start(tsd_server *srv);
/* At exit, after the store is freed: unlock and free (files stay). */
void tsd_datadir_free(tsd_server *srv);
/*
 * An upload (or tensor bin) of len record bytes is about to be received. 1: not for the data dir
 * (none configured, or len < --data-min): use the heap or a memfd. 0: *out is a TSD_BACK_FILE
 * own item with one reference whose len bytes at tsd_item_data() are writable (the file's
 * page cache; zero-filled); tsd_item_set_len may lower its length before the commit. <0
 * (TS_EOOM: --max-disk, or the file could not be made; TS_ENOMEM): refuse the write with
 * OUT_OF_MEMORY and the message of tsd_datadir_refusal; nothing is held.
 */
int tsd_datadir_alloc(tsd_server *srv, size_t len, tsd_item **out);
/* The message for a refused alloc (rc) of len bytes, NUL-terminated in buf (cap bytes). */
void tsd_datadir_refusal(const tsd_server *srv, int rc, size_t len, char *buf, size_t cap);
/*
 * The item (a TSD_BACK_FILE one) was just stored into bin by tsd_store_add with the version
 * srv->version: write its header (sequence number = that version, flags TSD_DATADIR_*), so it
 * is loaded at the next start. Call it right after tsd_store_add succeeded. No-op (0) for other
 * items. Returns 0.
 */
int tsd_datadir_commit(tsd_server *srv, tsd_item *it, const uint8_t *bin, size_t bin_len,
                       unsigned flags);
/*
 * The store let go of it (replaced by a PUT, taken by GET, bin deleted; not the store's freeing
 * at shutdown): its file is renamed to <id>.gone at once, so it never comes back after a
 * restart, and removed with the last reference. No-op for other items; srv may be NULL.
 */
void tsd_datadir_drop(tsd_server *srv, tsd_item *it);
/* The last reference of a TSD_BACK_FILE item went: unmap it and free own (store.c/shm.c). */
void tsd_datadir_release(tsd_item_own *own);
/* A fresh O_RDONLY descriptor of the item's file (dropped or not), or a negative errno. */
int tsd_datadir_open_ro(tsd_server *srv, const tsd_item *it);
typedef struct tsd_datadir_stats {
    uint64_t disk_bytes; /* bytes of the files (whole pages), counted against max_disk */
    uint64_t files;      /* files in existence, items not yet released */
    uint64_t max_disk;   /* 0 = unlimited */
    uint64_t loaded;     /* items loaded at start */
    uint64_t damaged;    /* files refused at start */
    uint64_t refused;    /* uploads refused (--max-disk, or the file could not be made) */
} tsd_datadir_stats;
void tsd_datadir_stats_get(const tsd_server *srv, tsd_datadir_stats *st);

/* A node of a name-keyed hash table; embedded first in bins and watches. */
typedef struct tsd_hnode {
    struct tsd_hnode *next;
    uint32_t hash;
    uint8_t name_len;
    uint8_t *name; /* name_len bytes, not NUL-terminated; owned by the containing object */
} tsd_hnode;

typedef struct tsd_htab {
    tsd_hnode **buckets;
    size_t mask; /* buckets - 1; a power of two minus one */
    size_t count;
} tsd_htab;

uint32_t tsd_hash(const uint8_t *name, size_t len);
/* 0 or TS_ENOMEM. */
int tsd_htab_init(tsd_htab *t);
/* Free the bucket array (the nodes belong to their owners). */
void tsd_htab_free(tsd_htab *t);
tsd_hnode *tsd_htab_find(const tsd_htab *t, const uint8_t *name, size_t len);
/* Link n (name and hash set). Never fails: when growing fails, chains just get longer. */
void tsd_htab_insert(tsd_htab *t, tsd_hnode *n);
void tsd_htab_remove(tsd_htab *t, tsd_hnode *n);

typedef struct tsd_bin {
    tsd_hnode node;
    tsd_item *head; /* oldest */
    tsd_item *tail; /* newest */
    uint32_t n_items;
    /*
     * The newest pass this bin is no part of, or has been handed to already (the store's
     * pass_gen when it was created or last captured): passes with a greater gen still need it.
     * It fills what was padding, so it costs nothing.
     */
    uint32_t view_mark;
    uint64_t bytes;   /* record bytes of the items */
    uint64_t version; /* change counter value of the bin's last change */
} tsd_bin;

/*
 * The bins and the memory accounting. held counts the record bytes of every linked item;
 * reserved counts uploads in progress (their buffers exist already). Items detached by a GET
 * but still being written are no longer counted: they are freed as soon as the write ends.
 */
typedef struct tsd_store {
    tsd_htab bins;
    uint64_t held;
    uint64_t reserved;
    uint64_t n_items;
    uint64_t max_memory; /* 0 = unlimited */
    /*
     * The rest of what clients make the daemon hold, counted against max_memory with held and
     * reserved (see tsd_store_used): bin structs, names and hash buckets plus item headers and
     * slot rounding (overhead); write batches and their arrays (output, conn.c); connection
     * objects and input buffers (conns, conn.c).
     */
    uint64_t overhead;
    uint64_t output;
    uint64_t conns;
    /*
     * Record bytes of items the store no longer holds but that other references (queued GET/PEEK
     * replies, snapshots) keep alive: dead items a slow reader would otherwise pin uncounted.
     */
    uint64_t orphaned_bytes;
    uint64_t name_bytes; /* bytes of every bin's name (sizes a snapshot's name buffer exactly) */
    /* Point-in-time passes being walked (see tsd_pass below). */
    struct tsd_pass *passes;
    size_t n_passes;
    uint32_t pass_gen; /* gen of the newest pass begun */
    uint64_t captures; /* bins handed to a pass ahead of a change (STATS view_captures) */
} tsd_store;

/* Every byte counted against max_memory: held + reserved + overhead + output + conns + orphaned. */
uint64_t tsd_store_used(const tsd_store *s);
/*
 * Bytes of one heap block holding n bytes, as glibc's allocator lays it out: an 8-byte size
 * word, rounded to 16, at least 32. Counting what the allocator really uses keeps the accounting
 * honest for the many small blocks of bins, streams and item headers.
 */
uint64_t tsd_heap_block(size_t n);
/*
 * Record bytes of it counted against --max-memory (store.held): all of them, but for an item in
 * a data-dir file, which --max-disk counts instead (its pages are the file's).
 */
uint64_t tsd_item_mem(const tsd_item *it);
/*
 * What an item costs beyond its record bytes (store.overhead): a slab item, its header and the
 * rounding of its slot; an item with a buffer of its own, its struct's block and the rounding of
 * its buffer.
 */
uint64_t tsd_item_overhead(const tsd_item *it);
/*
 * The store (or a stream) lets go of an unlinked item while someone else may still hold it (a
 * queued reply or a snapshot). When others do, its bytes stay in memory until the last of them
 * goes, so they count in orphaned_bytes until then (tsd_item_unref). Loop thread: references are
 * only dropped there, so a count above one cannot fall to one meanwhile. The caller still drops
 * its own reference afterwards.
 */
void tsd_store_item_release(tsd_store *s, tsd_item *it);
/*
 * Count n bytes of bookkeeping (streams, tables, waits) against --max-memory, in store.overhead
 * and in *cost when cost is not NULL (the structure's own total). 0, or TS_EOOM (counted in
 * stats.oom_rejections) when n would pass the limit; then nothing is counted. Loop thread.
 */
int tsd_store_charge(tsd_server *srv, uint64_t *cost, uint64_t n);
/* Give back n bytes counted by tsd_store_charge (from *cost too when cost is not NULL). */
void tsd_store_uncharge(tsd_server *srv, uint64_t *cost, uint64_t n);
/*
 * A stream or a table takes an item that arrived as an upload: its reservation of
 * tsd_item_len(it) becomes held bytes and its overhead is counted. Loop thread.
 */
void tsd_store_item_take(tsd_store *s, tsd_item *it);
/*
 * A stream or a table lets go of an item it took and drops its reference. orphan is 1 when a
 * queued reply or a snapshot may still hold it (its bytes then count as orphaned until the last
 * reference goes, tsd_store_item_release), 0 only when the store itself goes (exit) or nobody
 * else can hold it.
 */
void tsd_store_item_drop(tsd_store *s, tsd_item *it, int orphan);
/*
 * Seed the name hash with a 16-byte key (tsd_store_init seeds it from getrandom once per process;
 * tests set their own). Call before any table holds a name.
 */
void tsd_hash_seed(const uint8_t key[16]);

int tsd_store_init(tsd_store *s, uint64_t max_memory);
/* Free every bin and drop the store's item references. */
void tsd_store_free(tsd_store *s);
/*
 * Reserve len bytes for an upload about to be received. TS_EOOM when held + reserved + len
 * would pass max_memory. The old content of a bin being replaced still counts: it is held until
 * the new item has fully arrived.
 */
int tsd_store_reserve(tsd_store *s, uint64_t len);
void tsd_store_unreserve(tsd_store *s, uint64_t len);
tsd_bin *tsd_store_find(tsd_store *s, const uint8_t *name, size_t len);
/*
 * Link item (its reference is transferred) into bin name, replacing the content when replace
 * is set, else appending (the bin is created when missing). The reservation of tsd_item_len(item)
 * is consumed. Sets the bin's version. Returns the bin, or NULL on allocation failure (then the
 * item is untouched and still the caller's, the reservation kept).
 */
tsd_bin *tsd_store_add(tsd_store *s, const uint8_t *name, size_t len, tsd_item *item, int replace,
                       uint64_t version);
/* Detach and return the oldest item of bin (its reference goes to the caller). */
tsd_item *tsd_store_pop(tsd_store *s, tsd_bin *bin);
/* Remove a bin with its items (unlink and free). */
void tsd_store_remove(tsd_store *s, tsd_bin *bin);
/*
 * bin is about to change in place (a tensor bin's WRITE_ROWS): hand it as it is now to the
 * passes that still need it (see the passes below).
 */
void tsd_store_touch(tsd_store *s, tsd_bin *bin);
/*
 * Every bin, sorted by name, into a new array (*out, ts__free it); TS_ENOMEM. *n is the count.
 */
int tsd_store_sorted(tsd_store *s, tsd_bin ***out, size_t *n);

/*
 * Point-in-time passes (store.c). A pass hands its owner (emit) every bin that existed when it
 * began, exactly once and with the bin's state of that moment, while the store keeps changing
 * between the steps of its walk. The walk visits buckets in the order of their bit-reversed
 * index, which the table's doubling never disturbs: cur, in the space of bit-reversed hashes,
 * divides the bins walked (below it) from those still ahead, whatever the table's size. A bin
 * about to change (PUT, APPEND, GET, DELETE, replaced or removed) that a pass still needs and
 * has not walked yet is emitted first (captured: item references and counters, no bytes); bins
 * created after the pass began carry its gen in view_mark and are skipped. Loop thread only.
 */
#define TSD_PASS_END ((uint64_t)1 << 32) /* cur once the walk is over */
typedef struct tsd_pass tsd_pass;
struct tsd_pass {
    /*
     * Set by the owner. emit takes bin as it is now (borrowed: copy or reference what it keeps)
     * and returns 0, or an error that ends the pass (err). done (view.c) is called once on the
     * loop thread when a walked view ends: status 0, the first error of emit, or TS_ECANCELED
     * when the store was freed.
     */
    int (*emit)(tsd_pass *p, const tsd_bin *bin);
    void (*done)(tsd_pass *p, int status);
    /*
     * Budget units an emitted bin costs per item on top of its one unit: 1 when emit visits
     * every item (a snapshot takes a reference on each), 0 when it does not (LIST).
     */
    uint32_t per_item;
    /* The store's and the walker's. */
    tsd_pass *prev, *next; /* in the store's passes */
    uint32_t gen;
    int err;
    uint64_t cur;
    uint64_t emitted; /* bins handed over */
    uint64_t work;    /* budget units its walk has used: buckets, bins and items (per_item) */
    uint32_t turns;   /* loop turns of its walk */
    uint64_t loop_ns; /* loop time of its walk */
};
/*
 * Begin p now (emit set; the rest is set here) and link it into the store's passes. 0, or
 * TS_EAGAIN when the 2^32 gens are used up while other passes run (walk it whole at once with
 * tsd_store_pass_run instead).
 */
int tsd_store_pass_begin(tsd_store *s, tsd_pass *p);
/*
 * Walk p on while less than *budget units are used: a unit per bucket and per bin, and per_item
 * units per item of each bin emitted. A bin is walked whole, so the last one may take the walk
 * past *budget. *budget is lowered by what was used (to 0 at most) and p->work raised by all of
 * it. 1 when the walk is over (or p->err is set, or the store was freed), else 0.
 */
int tsd_store_pass_step(tsd_store *s, tsd_pass *p, size_t *budget);
/* Unlink p from the store's passes (after its walk is over, or to abandon it). */
void tsd_store_pass_end(tsd_store *s, tsd_pass *p);
/* Walk a pass whole, now, without linking it: every bin. Returns p->err. */
int tsd_store_pass_run(tsd_store *s, tsd_pass *p);

/*
 * Views (view.c): passes walked by the loop, TSD_VIEW_CHUNK units (buckets, bins and, for a
 * snapshot, items) per loop turn in all (shared by the views in turn) and no longer than
 * TSD_VIEW_TURN_US (checked every TSD_VIEW_SLICE units), so that a LIST or SAVE of any size
 * holds up the other clients for about a millisecond at a time, however many bins and items
 * there are. A bin is walked (or captured) whole: one bin of very many items costs a snapshot
 * one step of that many references.
 */
#define TSD_VIEW_CHUNK   4096u /* units walked per loop turn (the bin that passes it finishes) */
#define TSD_VIEW_SLICE   512u  /* units walked between two looks at the clock */
#define TSD_VIEW_TURN_US 1000u /* us; a turn's walking stops at the first slice past this */
struct tsd_server;
/*
 * Start walking p (emit and done set). 0: its walk goes on over the next loop turns and
 * p->done is called when it ends. 1: it was walked whole at once (no loop handle could be had,
 * or the gens were used up) and done is NOT called: p->err tells how it went.
 */
int tsd_view_start(struct tsd_server *srv, tsd_pass *p);

/* ---------------------------------------------------------------------------------------------
 * Connections (conn.c; their output queue is output.c)
 */
typedef struct tsd_server tsd_server;
typedef struct tsd_sub tsd_sub;
typedef struct tsd_waiter tsd_waiter;

/* A piece of a write batch: ptr == NULL means bytes [off, off+len) of the batch's small buffer. */
typedef struct tsd_wseg {
    const uint8_t *ptr;
    size_t off;
    size_t len;
} tsd_wseg;

/*
 * One uv_write: small bytes (headers, small bodies, padding) gathered in one buffer plus the
 * item buffers it references. Replies appended while the connection is being processed go into
 * the same batch, so a pipeline of small requests costs one write system call.
 */
typedef struct tsd_wbatch {
    uv_write_t req;
    struct tsd_conn *conn;
    uint8_t *small;
    size_t small_len, small_cap;
    tsd_wseg *segs;
    size_t nsegs, segs_cap;
    tsd_item **items; /* references held until the write callback */
    size_t nitems, items_cap;
    uv_buf_t *bufs;
    size_t bufs_cap;
    size_t nbufs; /* uv_bufs the batch needs when written (bufs_cap is kept at least this) */
    uint64_t bytes;
    uint64_t cost; /* bytes of its allocations, as counted in out_mem and store.output */
    struct tsd_wbatch *next_free;
    /*
     * Descriptors sent with the batch's first byte (the first frame of the batch is the reply
     * that carries them: see tsd_out_cut). owned ones are closed once sent or dropped.
     */
    uint32_t nfds;
    int fds[TS_MAX_REF_ITEMS];
    uint8_t fd_owned[TS_MAX_REF_ITEMS];
    size_t nk;                   /* uv_bufs built for the batch, while it waits (fdq) */
    struct tsd_wbatch *fdq_next; /* in the connection's fdq */
} tsd_wbatch;

enum {
    TSD_RS_HDR = 0, /* reading headers and control bodies into ibuf */
    TSD_RS_ITEM,    /* reading a record straight into an item buffer */
    TSD_RS_LZ4,     /* reading a compressed body into a temporary buffer */
    TSD_RS_DISCARD, /* skipping the body of a refused upload */
    TSD_RS_WORK,    /* off-loop work for this request (upload, LIST): reading paused */
    TSD_RS_DEAD     /* reading stopped (error or closing) */
};

/*
 * A frame that needs no allocation, with its own write request: a reply that could not be
 * queued for lack of memory goes out through one of these (as it was when its body is small,
 * else as an OUT_OF_MEMORY error), right after the replies queued before it.
 */
typedef struct tsd_emerg {
    uv_write_t req;
    uv_buf_t buf;
    int busy;
    uint8_t frame[TS_HDR_SIZE + TSD_EMERG_MSG];
} tsd_emerg;

typedef struct tsd_conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_tcp_t tcp;
        uv_pipe_t pipe;
    } h;
    tsd_server *srv;
    struct tsd_conn *prev, *next; /* the server's list of connections */
    uint64_t id;
    int is_unix;
    int uncounted; /* refused (too many clients): not counted in n_conns */
    int unauth;    /* counted in the server's n_unauth (HELLO not yet completed) */
    char peer[64]; /* "ip:port" or "unix", for log lines */
    /* AUTH_CHALLENGE answered: the client's nonce, then the server's (the token proof). */
    int auth_challenged;
    uint8_t auth_nonces[2 * TS_MSG_AUTH_NONCE_SIZE];
    /* TLS on this TCP connection (tls.c), or NULL: plain. */
    struct tsd_tls *tls;
    int helloed;
    int lz4;                 /* the client may send TS_FLAG_LZ4 bodies */
    int closing;             /* uv_close called */
    int close_after_flush;   /* close once every queued write is done */
    int let_go;              /* closing: its waits, subscriptions and services were dropped */
    int out_blocked;         /* no further output is accepted (cut off, or closing) */
    uint64_t close_deadline; /* uv_now ms; forced close of a lingering connection */
    int eof;                 /* the peer closed its side */
    int shut_started, shut_done;
    uv_shutdown_t shut_req;

    /* Input. */
    int rstate;    /* TSD_RS_* */
    uint8_t *ibuf; /* TSD_IBUF_SIZE bytes, allocated on the first read */
    size_t ipos, ilen;
    ts__hdr cur; /* header of the frame whose body is being received */
    uint8_t cur_name[TS_MAX_NAME_LEN];
    uint8_t cur_name_len;
    /* An upload's fixed fields between name and record (ts__msg_op upload_fixed). */
    uint8_t cur_fixed[TS_MSG_MAX_UPLOAD_FIXED];
    uint8_t cur_fixed_len;
    tsd_item *cur_item; /* TSD_RS_ITEM; also the lz4 target */
    uint8_t *cur_tmp;   /* TSD_RS_LZ4: compressed body */
    size_t cur_tmp_len;
    uint64_t cur_reserved; /* bytes reserved in the store for this upload */
    uint64_t cur_step;     /* bytes the next reservation step of this upload may take */
    int cur_capped;       /* TSD_RS_DISCARD: refused because uploads in progress hold their share */
    uint64_t cur_raw_len; /* TSD_RS_LZ4: announced raw length */
    int cur_alloc_failed; /* TSD_RS_DISCARD: refused for a failed allocation, not the limit */
    int cur_refused;      /* TSD_RS_DISCARD: refused because snapshots fail (SAVE_FAILING) */
    int cur_disk_rc;      /* TSD_RS_DISCARD: refused by the data directory (tsd_datadir_alloc) */
    /*
     * TSD_RS_DISCARD: a STREAM_APPEND refused once its name was in (the status it gets), or a
     * TABLE_INSERT once its fixed fields were in (table.c's reason, tsd_table_insert_check).
     */
    uint16_t cur_stream_status;
    /* TSD_RS_DISCARD: an upload naming another shard's bin (shard.c). */
    int cur_wrong_shard;
    uint8_t *bulk_dst;      /* where the next bytes go (RS_ITEM, RS_LZ4) */
    uint64_t bulk_left;     /* bytes of the body still to come */
    uint64_t bulk_total;    /* bytes of the body being received in bulk (item or compressed) */
    uint64_t last_input_ms; /* uv_now of the last bytes read, for the body deadline */
    uint64_t out_mem;       /* bytes of allocations of the write batches queued or in flight */
    /* Off-loop inflation and validation of a large record (TSD_RS_WORK). */
    struct {
        uv_work_t req;
        int busy;
        int rc;
        tsd_item *it;
        uint8_t *tmp; /* compressed body (NULL: validation only) */
        size_t tmp_len;
        size_t raw;
    } job;

    /* Held while other work for its current request runs (tsd_conn_hold): input waits. */
    int held;
    uint8_t held_op; /* the held request, answered SHUTTING_DOWN when tensord stops */
    uint32_t held_rid;
    /* Closed while held or while its off-loop upload work ran: free it when that is back. */
    int free_after;

    /* Output. */
    tsd_wbatch *pend; /* not yet handed to uv_write */
    tsd_wbatch *batch_cache;
    size_t n_cached;
    unsigned writes_in_flight;
    struct tsd_conn *dirty_next;
    int dirty;

    /*
     * The reply being queued: where the pending batch stood when it began, so that a reply
     * that fails for lack of memory is taken back whole and replaced by an error frame.
     */
    struct {
        int active, failed, had_pend;
        uint8_t op;
        uint32_t rid;
        uint16_t status;
        /* tsd_reply's frame, sent as it is through an emergency slot when small enough. */
        const void *body;
        size_t body_len;
        uint16_t body_status;
        size_t small_len, nsegs, last_len, nitems, nbufs;
        uint64_t bytes;
        uint32_t nfds;
    } mk;
    tsd_emerg emerg[TSD_EMERG_FRAMES];

    uint64_t accepted_ms; /* uv_now at accept, for the HELLO deadline */
    uint64_t soft_since;  /* uv_now when output went over the soft limit; 0 = it is not */
    int starved;          /* reading paused: no input buffer could be allocated */
    struct tsd_conn *starved_next;

    /*
     * Descriptors (unix connections with HELLO FDS). Received ones wait in fds_in, oldest first,
     * until a frame claims them (at most TSD_MAX_PENDING_FDS). Batches that carry descriptors
     * are sent with sendmsg when nothing is queued before them; until then they wait in fdq, and
     * every later batch behind them (fdq_bytes: their bytes), so the order on the wire stays.
     * Every other batch waits in fdq too while a write is in flight: libuv is handed one write
     * at a time, so a slow reader's cut-off drops all the rest (output.c, batch_go).
     */
    int fds_ok;
    int fds_in[TSD_MAX_PENDING_FDS];
    uint32_t n_fds_in;
    int claimed_fd; /* taken from fds_in for the frame being handled (PUT_FD); -1 = none */
    tsd_wbatch *fdq_head, *fdq_tail;
    uint64_t fdq_bytes;
    int fd_blocked; /* in the server's fd_blocked list: the socket was full, retry on a timer */
    struct tsd_conn *fd_blocked_next;

    /* Subscriptions and waiters (notify.c). */
    tsd_sub *subs;
    tsd_waiter *waiters;
    tsd_sub *held_head, *held_tail; /* subscriptions holding a coalesced notification */
    uint32_t n_watch;               /* subscriptions + waiters, capped by cfg.max_watch */
    struct tsd_swait *swaits;       /* pending stream waits (stream.c; counted in n_watch) */
    struct tsd_twait *twaits;       /* pending replay table waits (table.c; in n_watch) */
    /* Services (service.c): its registrations, the calls it was handed and has not answered,
     * and the calls it made that wait for an answer (counted in n_watch). */
    struct tsd_svc_reg *svc_regs;
    struct tsd_svc_call *svc_handed;
    struct tsd_svc_call *svc_calls;
    /* Latency (tsd_stats.timing): ts__now_ns of the last read, and of an upload's header. */
    uint64_t t_in;
    uint64_t up_t0;
} tsd_conn;

/*
 * A zeroed connection object for the next accept, or NULL. Allocated before accept(2), so that
 * a failure leaves the client waiting in the listen queue instead of being dropped.
 */
tsd_conn *tsd_conn_alloc(void);
/*
 * Serve accepted socket fd (is_unix: a unix socket) with c (from tsd_conn_alloc; ownership
 * passes). The connection is served, or refused with TOO_MANY_CLIENTS; on a libuv error it is
 * closed.
 */
void tsd_conn_accept(tsd_server *srv, tsd_conn *c, int fd, int is_unix);
/*
 * Housekeeping for one connection (cron): the HELLO deadline, the body deadline, the close
 * deadline of a connection on its way out, then the output's part (tsd_out_cron). now is uv_now.
 */
void tsd_conn_cron(tsd_conn *c, uint64_t now);
/* Resume reading on a connection that was starved of an input buffer. */
void tsd_conn_resume_read(tsd_conn *c);

/*
 * The value of a flag that takes a string that must not be empty (server.c): val when the flag
 * came as --flag=val, else the next argument (*i moves past it). 1 with *dst set, or -1 after
 * printing why (no value, or an empty one).
 */
int tsd_flag_string(const char *flag, const char *val, int argc, char **argv, int *i,
                    const char **dst);

/*
 * Sharding (shard.c, docs/PROTOCOL.md section 14). tsd_shard_flag: parse --shard or
 * --cluster-map (1: taken, 0: not one, -1: bad, printed); tsd_shard_usage: their --help lines;
 * tsd_shard_setup: make cfg->shard_map from them (0, or -1 after printing why; no flags: no
 * map); tsd_shard_cleanup: free it at exit; tsd_shard_log: say at start which slots are ours.
 * tsd_shard_foreign: 1 when a sharded daemon does not own name's slot (0 without a map).
 * tsd_shard_refuse: the same, and then answers WRONG_SHARD (counted in stats.wrong_shard) for
 * the request op/rid. tsd_shard_refuse_request: tsd_shard_refuse for a decoded control request
 * whose raw body is body/len: its name, or each of MGET's names; 0 for requests that name
 * nothing. tsd_shard_map_reply: answer SHARD_MAP. Loop thread, like everything here.
 */
int tsd_shard_flag(tsd_config *cfg, const char *flag, const char *val, int argc, char **argv,
                   int *i);
void tsd_shard_usage(FILE *f);
int tsd_shard_setup(tsd_config *cfg);
void tsd_shard_cleanup(tsd_config *cfg);
void tsd_shard_log(const tsd_config *cfg);
int tsd_shard_foreign(const tsd_server *srv, const uint8_t *name, size_t len);
int tsd_shard_refuse(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t len);
int tsd_shard_refuse_request(tsd_conn *c, const ts__hdr *h, const ts__msg *m, const uint8_t *body,
                             size_t len);
void tsd_shard_map_reply(tsd_conn *c, const ts__hdr *h);

/*
 * TLS (tls.c). tsd_tls_flag: parse a --tls-* flag (1: taken, 0: not one, -1: bad, printed; a
 * build without TLS refuses them); tsd_tls_usage: their --help lines; tsd_tls_setup: check them
 * and make cfg->tls_ctx (0, or -1 after printing why); tsd_tls_cleanup: free it at exit.
 * tsd_conn_tls_start: TLS on accepted TCP connection c (0, or -1: close it);
 * tsd_conn_tls_handshaking: 1 while c is a TLS connection whose handshake has not completed.
 */
int tsd_tls_flag(tsd_config *cfg, const char *flag, const char *val, int argc, char **argv, int *i);
void tsd_tls_usage(FILE *f);
int tsd_tls_setup(tsd_config *cfg);
void tsd_tls_cleanup(tsd_config *cfg);
int tsd_conn_tls_start(tsd_conn *c);
int tsd_conn_tls_handshaking(const tsd_conn *c);
/*
 * A connection's stream calls, used instead of libuv's: through TLS when c->tls is set (the
 * handshake runs first by itself; try_write then always says UV_EAGAIN), plain otherwise.
 * Same contracts as uv_read_start, uv_read_stop, uv_write, uv_try_write, uv_shutdown,
 * uv_stream_get_write_queue_size and uv_close.
 */
int tsd_read_start(tsd_conn *c, uv_alloc_cb alloc_cb, uv_read_cb read_cb);
void tsd_read_stop(tsd_conn *c);
int tsd_stream_write(tsd_conn *c, uv_write_t *req, const uv_buf_t *bufs, unsigned int n,
                     uv_write_cb cb);
int tsd_stream_try_write(tsd_conn *c, const uv_buf_t *bufs, unsigned int n);
int tsd_stream_shutdown(tsd_conn *c, uv_shutdown_t *req, uv_shutdown_cb cb);
size_t tsd_stream_queue_size(tsd_conn *c);
void tsd_stream_close(tsd_conn *c, uv_close_cb cb);
/* Close now (asynchronously freed); safe to call twice. */
void tsd_conn_close(tsd_conn *c);
/*
 * Release whatever an interrupted upload holds: item, temporary buffer, reservation (nothing
 * while off-loop work owns them; they are released when it returns).
 */
void tsd_conn_drop_upload(tsd_conn *c);
/*
 * Hold c while work for its current request (op, rid) runs elsewhere (a LIST sorted on the
 * thread pool): its input is no longer read nor processed, so the replies of its later requests
 * cannot overtake that request's reply, and a close meanwhile does not free it. Every hold ends
 * with exactly one tsd_conn_release. Not while off-loop upload work runs (that has its own
 * state). A held request still unanswered when tensord stops gets SHUTTING_DOWN (the work's own
 * reply is then dropped: no more output is accepted).
 */
void tsd_conn_hold(tsd_conn *c, uint8_t op, uint32_t rid);
/*
 * End the hold: free c when it was closed meanwhile (c must not be used afterwards then), else
 * process the requests already buffered and read on. Call it after the held request's reply is
 * queued.
 */
void tsd_conn_release(tsd_conn *c);

/* ---------------------------------------------------------------------------------------------
 * Output (output.c)
 *
 * Every reply (op, rid; TS_OP_NOTIFY and 0 for notifications) starts with tsd_out_begin, which
 * applies the output limits: it returns 0 when the reply may be queued, or -1 when the connection
 * takes no more output (the caller drops the reply). tsd_out_bytes returns room for n small bytes
 * in the pending batch (valid until the next tsd_out_* call) or NULL on allocation failure. After
 * a failure the reply's partial bytes are taken back, every later tsd_out_* call of the same reply
 * fails too, and the request gets an error frame instead (a notification gets nothing: the caller
 * holds it for later). Bodies are encoded with src/msg.c into the room tsd_out_bytes gives.
 */
int tsd_out_begin(tsd_conn *c, uint8_t op, uint32_t rid);
uint8_t *tsd_out_bytes(tsd_conn *c, size_t n);
/* Queue the item's bytes and its padding to 64; takes a reference (ref=1) or consumes one. */
int tsd_out_item(tsd_conn *c, tsd_item *it, int ref);
/* Keep a reference to it until the reply is written (its descriptor goes with the reply). */
int tsd_out_hold(tsd_conn *c, tsd_item *it);
/* Queue a frame header. */
int tsd_out_hdr(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t body_len);
/* A whole reply with a small body (already encoded). */
void tsd_reply(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const void *body,
               size_t len);
/* An error reply whose body is the message msg (n bytes, at most TS_MAX_ERRMSG). */
void tsd_reply_msg(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *msg,
                   size_t n);
/* An error reply with a formatted message (the connection stays open). */
void tsd_reply_err(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* A TS_BIN_STATE reply. */
void tsd_reply_state(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t version,
                     uint32_t n_items);
/*
 * OUT_OF_MEMORY for a request that did not get its memory: rc TS_EOOM is --max-memory, anything
 * else tensord's own allocation failing (counted in stats.out_of_memory). what ends the message.
 */
void tsd_reply_oom(tsd_conn *c, uint8_t op, uint32_t rid, int rc, const char *what);
/*
 * The answer to a stream or table request that could not wait: rc TS_ETOOMANY (--max-watch) is
 * INVALID, the rest as tsd_reply_oom (... "waiting").
 */
void tsd_reply_wait_error(tsd_conn *c, uint8_t op, uint32_t rid, int rc);
/*
 * A protocol error: queue an error reply (status, message), stop reading, close after the reply
 * is written. Counts in stats.
 */
void tsd_conn_fail(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Hand the pending batch to uv_write. */
void tsd_conn_flush(tsd_conn *c);
/* Bytes of output queued on c and not yet taken by the socket (and their bookkeeping). */
uint64_t tsd_conn_unwritten(tsd_conn *c);
/*
 * Stop serving c: no more requests are read (input is drained and dropped), no more output is
 * accepted, and it closes once its queued writes are done and the peer has seen our FIN (or at
 * the grace deadline).
 */
void tsd_conn_begin_closing(tsd_conn *c);
/* Close every descriptor c received and holds unclaimed (and one claimed, not yet taken). */
void tsd_conn_fds_close(tsd_conn *c);
/* A connection on its way out whose output is all written: send FIN, then close. */
void tsd_conn_maybe_finish(tsd_conn *c);
/*
 * Tell c, with a connection-level frame (opcode 0, request id 0) of status and msg, that it is
 * closing, and begin closing it. The frame goes out even without memory (an emergency slot).
 */
void tsd_conn_closing_frame(tsd_conn *c, uint16_t status, const char *msg);
/*
 * tensord is stopping: answer SHUTTING_DOWN every request of c still waiting for its reply (its
 * pending WAITs, the request being served when its reply is still to come: a held LIST, an
 * upload being received, skipped or inflated off the loop; then the requests complete in its
 * input buffer behind it), drop its subscriptions, send the connection-level SHUTTING_DOWN frame
 * and begin closing (reading on, to drop what it still sends). A connection already on its way
 * out (told why after an error) only loses its subscriptions and waiters. Returns the number of
 * requests answered.
 */
size_t tsd_conn_stop(tsd_conn *c);
/* The output's housekeeping (cron): the soft output limit, held notifications. */
void tsd_out_cron(tsd_conn *c, uint64_t now);
/* Drop the batch not yet handed to the socket and those waiting in fdq (closing). */
void tsd_out_drop_pending(tsd_conn *c);
/*
 * Descriptors in replies. Before tsd_out_begin of a reply that carries descriptors, call
 * tsd_out_cut: the batch pending so far goes to the socket, so the reply starts a batch of its
 * own and its descriptors travel with its first byte. Then tsd_out_fd attaches each (at most
 * TS_MAX_REF_ITEMS per reply; owned: closed once sent or if the reply is dropped). 0 or -1
 * (the reply failed, as tsd_out_bytes; an owned fd is closed then).
 */
void tsd_out_cut(tsd_conn *c);
int tsd_out_fd(tsd_conn *c, int fd, int owned);
/* The retry timer: try c's waiting descriptor frame again. */
void tsd_out_fd_retry(tsd_conn *c);
/*
 * ms; a descriptor frame that met a full socket is tried again after this long, then after twice
 * as long while the socket stays full, up to TSD_FD_RETRY_MAX_MS (a reader that stopped reading
 * costs a few wake-ups a second, and the output limits end it in time).
 */
#define TSD_FD_RETRY_MS     2
#define TSD_FD_RETRY_MAX_MS 100
/* Free the batches kept for reuse (freeing the connection). */
void tsd_out_free_cache(tsd_conn *c);

/*
 * Copy a bin name into out (cap bytes incl. NUL) as printable UTF-8 for messages and the log:
 * bytes below 0x20, 0x7f, the C1 controls (U+0080..U+009F) and bytes of invalid UTF-8 become
 * \xNN and a backslash \\, as tsctl prints names. A byte takes at most 4, so a cap of
 * TS_MAX_NAME_LEN * 4 + 1 holds any name; a smaller one cuts it at a whole character.
 */
void tsd_name_printable(const uint8_t *name, size_t len, char *out, size_t cap);

/* ---------------------------------------------------------------------------------------------
 * Requests (ops.c)
 */
/*
 * LIST of at least this many bins takes a view (view.c): the loop copies the entries a chunk
 * per turn, and the sort and the body (most of the time) run on the thread pool. Fewer are
 * answered at once, on the loop (at most this many entries: well under a millisecond).
 */
#define TSD_LIST_OFFLOOP_MIN 4096u
typedef struct tsd_list_job tsd_list_job;
/* Handle a complete control request (every opcode but PUT/APPEND) whose body is in memory. */
void tsd_op_dispatch(tsd_conn *c, const ts__hdr *h, const uint8_t *body, size_t len);
/*
 * Finish a PUT/APPEND whose record has been received into item (the reference and the store
 * reservation of tsd_item_len(item) go to the store, or are released on failure).
 */
void tsd_op_store(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                  tsd_item *item);
/*
 * Answer op/rid with the oldest max_items (0: all) items of bin (named name) as an ITEMS reply.
 * With remove (GET, TAKE) they then leave the bin as one change, notified as a GET. 0, or -1
 * when the connection takes no more output (nothing changed then).
 */
int tsd_reply_items(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t nl,
                    tsd_bin *bin, uint32_t max_items, int remove);
/*
 * Check a HELLO token against the configured one, in time that depends only on the configured
 * token's length. 0 when acceptable (or no token is configured), TS_EAUTH otherwise.
 */
int tsd_auth_check(tsd_server *srv, const uint8_t *token, size_t len);

/* ---------------------------------------------------------------------------------------------
 * Tensor bins and rows (rows.c)
 */
/* Dimensions of a tensor bin's tensor: 1 (a tensor of rows needs one) to the record format's 8. */
#define TSD_TENSOR_BIN_MAX_NDIM TS_MAX_NDIM
/*
 * Indexes of one GATHER_ROWS (4 Mi, a 32 MiB index tensor). Each is a row copied on the loop
 * thread, so the bound keeps one request's loop time in the tens of milliseconds for small rows;
 * the reply's bytes are bounded by --max-memory besides.
 */
#define TSD_MAX_GATHER_ROWS ((uint64_t)1 << 22)
/* 1 when b is a tensor bin: its one item is live (made by TENSOR_BIN, written in place). */
int tsd_bin_is_tensor(const tsd_bin *b);
/*
 * The item of a new tensor bin, as TENSOR_BIN makes it (snapshot.c restores tensor bins through
 * it too): len bytes, zero-filled and marked live, in a --data-dir file when the data directory
 * takes a record of len bytes (against --max-disk), else in a memfd or on the heap (against
 * --max-memory), with a reservation of len bytes on the store that tsd_store_add consumes. The
 * caller writes the record's head and links it, then calls tsd_datadir_commit with
 * TSD_DATADIR_TENSOR. Returns 0 and *out (one reference); TSD_TENSOR_ITEM_LIMIT when --max-memory
 * refuses it; TSD_TENSOR_ITEM_NOMEM when the memory could not be had; or tsd_datadir_alloc's
 * negative code when its file is refused (tsd_datadir_refusal says why). Nothing is reserved but
 * on success.
 */
#define TSD_TENSOR_ITEM_LIMIT 1
#define TSD_TENSOR_ITEM_NOMEM 2
int tsd_rows_tensor_item(tsd_server *srv, size_t len, tsd_item **out);
/* Handle TENSOR_BIN or READ_ROWS (m decoded by tsd_op_dispatch). */
void tsd_rows_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);
/*
 * Finish a GATHER_ROWS or WRITE_ROWS whose record has been received and validated into item, as
 * tsd_op_store does for PUT: the reference and the store reservation of tsd_item_len(item) are
 * the callee's, which answers the request and releases both.
 */
void tsd_rows_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                     tsd_item *item);

/* ---------------------------------------------------------------------------------------------
 * Listeners and waiters (notify.c)
 */
/*
 * The bounded wake-up. A change visits at most TSD_WAKE_BUDGET listeners and waiters of its bin
 * at once; the rest are visited on the next loop turns (the server's wake queue, served by an
 * idle handle, at most TSD_WAKE_BUDGET visits per turn), so one PUT never holds up the other
 * clients for long. Waiter deadlines live in one heap with one timer, and at most
 * TSD_WAKE_BUDGET expired waiters are answered per turn.
 */
#define TSD_WAKE_BUDGET 1024u

typedef struct tsd_watch {
    tsd_hnode node;
    tsd_sub *subs;
    tsd_waiter *waiters;
    /* The latest change of the bin, which listeners not yet visited are told about. */
    uint64_t seq; /* changes of the bin since the watch exists */
    uint64_t n_version;
    uint32_t n_items;
    uint8_t n_event;
    int in_pass;        /* being visited: not freed even when it has no one left */
    int queued;         /* in the server's wake queue */
    tsd_sub *sub_cur;   /* the next listener to visit, NULL when none is left */
    tsd_waiter *wt_cur; /* the next waiter to check, NULL when none is left */
    struct tsd_watch *qprev, *qnext;
} tsd_watch;

struct tsd_sub {
    tsd_watch *w;
    tsd_conn *c;
    tsd_sub *wprev, *wnext; /* in the watch */
    tsd_sub *cprev, *cnext; /* in the connection */
    uint64_t seen;          /* the watch's seq of the last change this listener was told of */
    /*
     * A notification held back while the connection's output is backed up: the latest change
     * of the bin, updated in place by later ones (held counts the changes it stands for).
     */
    uint32_t held;
    uint64_t h_version;
    uint32_t h_n_items;
    uint8_t h_event;
    tsd_sub *hprev, *hnext; /* in the connection's held list */
};

struct tsd_waiter {
    tsd_watch *w;
    tsd_conn *c;
    uint32_t rid;
    uint64_t after;
    uint64_t deadline; /* uv_now ms */
    uint64_t seq;      /* order of arrival: waiters with one deadline time out in this order */
    size_t heap_idx;   /* place in the server's deadline heap */
    tsd_waiter *wprev, *wnext;
    tsd_waiter *cprev, *cnext;
};

/* What a subscription, a waiter and a watch count against --max-memory, in bytes. */
#define TSD_SUB_COST            ((uint64_t)sizeof(tsd_sub))
#define TSD_WAITER_COST         ((uint64_t)(sizeof(tsd_waiter) + sizeof(tsd_waiter *)))
#define TSD_WATCH_COST(namelen) ((uint64_t)sizeof(tsd_watch) + (uint64_t)(namelen) + 1u)

/*
 * Subscribe c to name. 0; TS_ETOOMANY when c is at --max-watch; TS_EOOM when --max-memory is
 * reached; TS_ENOMEM. Listening twice is the same as once (and never refused).
 */
int tsd_listen(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len);
/* 0, or TS_ENOENT when c does not listen to name. */
int tsd_unlisten(tsd_server *srv, tsd_conn *c, const uint8_t *name, size_t len);
/*
 * Park a WAIT until the bin exists with a version above after, or timeout_ms passes. 0;
 * TS_ETOOMANY (--max-watch); TS_EOOM (--max-memory); TS_ENOMEM.
 */
int tsd_wait_add(tsd_server *srv, tsd_conn *c, uint32_t rid, const uint8_t *name, size_t len,
                 uint64_t after, uint32_t timeout_ms);
/*
 * A bin changed (the store already shows the change): NOTIFY every listener (after the writer's
 * own reply, which the caller queued first) and answer the waiters the bin's new state satisfies
 * (see TSD_WAKE_BUDGET: some of both may be served on later loop turns).
 */
void tsd_notify_change(tsd_server *srv, const uint8_t *name, size_t len, uint64_t version,
                       uint32_t n_items, uint8_t event);
/* Drop every subscription and waiter of a closing connection. */
void tsd_notify_conn_gone(tsd_server *srv, tsd_conn *c);
/*
 * tensord is stopping: answer each pending WAIT of c with SHUTTING_DOWN, then drop its waiters
 * and subscriptions. Returns the number of WAITs answered.
 */
size_t tsd_notify_conn_stop(tsd_server *srv, tsd_conn *c);
/* Send the notifications c holds back, as far as its output backlog allows. */
void tsd_notify_release_held(tsd_server *srv, tsd_conn *c);
size_t tsd_notify_n_waiters(const tsd_server *srv);

/* ---------------------------------------------------------------------------------------------
 * Statistics (stats.c; served over HTTP by metrics.c and http.c, see http.h)
 */
/* Status codes counted in tsd_stats.errors (wire statuses are far fewer). */
#define TSD_STATUS_SLOTS 64
/*
 * Upper bounds of the latency histogram's buckets in nanoseconds, 10 us to 10 s in 1-2.5-5
 * steps (metrics.c names them in seconds); one more bucket counts what is slower.
 */
#define TSD_LAT_BOUNDS 19
extern const uint64_t tsd_lat_bounds_ns[TSD_LAT_BOUNDS];
typedef struct tsd_latency {
    uint64_t n[TSD_LAT_BOUNDS + 1]; /* observations per bucket (not cumulative), then slower */
    uint64_t sum_ns;                /* their total */
} tsd_latency;

typedef struct tsd_stats {
    uint64_t ops[TS_OP_EMB_PUSH + 1]; /* requests handled, by opcode */
    uint64_t notifications_sent;
    uint64_t protocol_errors;
    uint64_t oom_rejections;
    uint64_t slow_readers;
    uint64_t rejected_clients;
    uint64_t connections_total;
    uint64_t bytes_received;
    uint64_t bytes_sent;    /* bytes of frames whose write completed */
    uint64_t body_timeouts; /* connections cut for a frame that stopped arriving */
    uint64_t listeners;
    uint64_t waiters;
    uint64_t watch_bytes;   /* bytes of subscriptions, waiters and watches (in --max-memory) */
    uint64_t wake_deferred; /* changes whose wake-up went on over later loop turns */
    uint64_t lists_offloop; /* LISTs sorted and encoded on the thread pool */
    uint64_t auth_failures;
    uint64_t hello_timeouts;
    uint64_t notes_coalesced; /* changes folded into a held notification */
    uint64_t out_of_memory;   /* allocations that failed while serving (error replies sent) */
    uint64_t accept_pauses;   /* times accepting paused (out of fds or memory) */
    uint64_t snapshots;
    uint64_t snapshot_failures;
    uint64_t snapshot_last_ms;          /* duration of the last snapshot write */
    uint64_t save_failures_consecutive; /* snapshots failed since the last one that succeeded */
    uint64_t last_save_time;            /* unix seconds of the last good snapshot; 0 = none */
    uint64_t writes_refused;            /* writes refused because snapshots were failing */
    uint64_t wrong_shard;               /* requests answered WRONG_SHARD (shard.c) */
    uint64_t snapshot_loop_us;          /* loop time of the last snapshot's walk, all its turns */
    uint64_t view_passes;               /* views begun (LISTs of many bins, snapshots) */
    uint64_t view_turns_last;           /* loop turns the last finished view's walk took */
    uint64_t view_turn_max_us;          /* the longest one loop turn spent walking views */
    /* Frames queued with a status other than OK, by status (metrics.c; larger ones uncounted). */
    uint64_t errors[TSD_STATUS_SLOTS];
    /*
     * Request latency by opcode (docs/METRICS.md says what is measured), kept only while timing
     * is set: metrics are served over HTTP (--http-port), so nobody pays for clocks unread.
     */
    int timing;
    tsd_latency latency[256];
} tsd_stats;

/*
 * Count one request of opcode op that took ns nanoseconds (loop thread). Most requests take
 * well under the first bound, so the scan from the smallest bound ends at once.
 */
static inline void tsd_latency_observe(tsd_stats *st, uint8_t op, uint64_t ns)
{
    unsigned b = 0;
    while (b < TSD_LAT_BOUNDS && ns > tsd_lat_bounds_ns[b])
        b++;
    st->latency[op].n[b]++;
    st->latency[op].sum_ns += ns;
}

/* Answer a STATS request. */
void tsd_stats_reply(tsd_conn *c, const ts__hdr *h);

/* ---------------------------------------------------------------------------------------------
 * Snapshots (snapshot.c)
 */
typedef struct tsd_snap_job tsd_snap_job;

/* A SAVE request waiting for a durable snapshot (c is NULL once its connection is gone). */
typedef struct tsd_save_waiter {
    tsd_conn *c;
    uint32_t rid;
    struct tsd_save_waiter *next;
} tsd_save_waiter;

/*
 * Load the snapshot at path into the (empty) store. Returns 0 (*counter = the saved change
 * counter), 1 when the file does not exist (nothing loaded), or -1 with a message in err: the
 * file is damaged, truncated or unreadable, and nothing has been loaded.
 */
int tsd_snapshot_load(tsd_store *store, const char *path, uint64_t *counter, char *err,
                      size_t err_cap);
/* Answer SAVE: reply once a snapshot holding every change made so far is durable. */
void tsd_snapshot_request(tsd_server *srv, tsd_conn *c, uint32_t rid);
/* Start a snapshot if none is running and something changed since the last one (timer). */
void tsd_snapshot_tick(tsd_server *srv);
/* At shutdown: write the final snapshot (after a running one) and free the store after it. */
void tsd_snapshot_final(tsd_server *srv);
/* Forget c in the SAVE waiters (its connection is closing). */
void tsd_snapshot_conn_gone(tsd_server *srv, tsd_conn *c);
/*
 * tensord is stopping: answer every SAVE not yet answered with SHUTTING_DOWN (the final snapshot
 * is written after the connections are told, so no SAVE can be confirmed by it) and forget them.
 * Returns the number answered.
 */
size_t tsd_snapshot_stop(tsd_server *srv);
/*
 * At start, before loading: check that the --save directory exists and lock PATH.lock (held
 * until tsd_snapshot_free), so that no two daemons write one snapshot. 0, or -1 with a
 * message in err (the configuration is unusable: exit TSD_EXIT_USAGE).
 */
int tsd_snapshot_prepare(tsd_server *srv, char *err, size_t err_cap);
/* At exit: drop what written snapshots still hold, and release the lock. */
void tsd_snapshot_free(tsd_server *srv);
/*
 * 1 while requests that change data (PUT, APPEND, GET, DELETE) must be refused: the last
 * snapshot failed and --stop-writes-on-save-error is on. Checked where each write is accepted.
 */
int tsd_writes_refused(const tsd_server *srv);
/* Refuse such a request (SAVE_FAILING, counted in writes_refused). */
void tsd_refuse_write(tsd_conn *c, uint8_t op, uint32_t rid);

/* ---------------------------------------------------------------------------------------------
 * The server (server.c)
 */
/* A listening socket, accepted by tensord itself so that accepting can pause. */
typedef struct tsd_listener {
    uv_poll_t poll;
    int fd;
    int is_unix;
    int active; /* initialized (needs closing) */
} tsd_listener;

struct tsd_server {
    uv_loop_t *loop;
    tsd_config cfg;
    tsd_listener lis[2]; /* TCP, unix */
    int bound_port;
    uv_signal_t sigint, sigterm, sighup;
    uv_timer_t cron;
    uv_timer_t accept_timer; /* resumes accepting after a pause */
    uv_timer_t retry_timer;  /* resumes reading of starved connections */
    uv_timer_t fd_timer;     /* retries descriptor frames whose socket was full */
    tsd_conn *fd_blocked;    /* connections waiting for fd_timer */
    uint32_t fd_retry_ms;    /* fd_timer's next delay: doubles while sockets stay full */
    int fd_retrying;         /* on_fd_retry is running */
    uv_timer_t save_timer;   /* periodic snapshots */
    uv_timer_t stop_timer;   /* shutdown: closes what is left after TSD_CLOSE_GRACE_MS */
    int stop_timer_open;     /* stop_timer is initialized and not yet closed */
    int handles_init;        /* the timers and signals above exist */
    int accept_paused;
    int fd_exhausted;         /* in an out-of-fds episode (logged once) */
    uint64_t fd_refused;      /* accept attempts that failed for lack of fds in this episode */
    tsd_conn *starved;        /* connections waiting for an input buffer */
    tsd_conn *spare;          /* allocated for the next accept */
    unsigned long alloc_base; /* ts__alloc_count() when start-up ended */
    /* Snapshots. */
    tsd_snap_job *snap_job;        /* the snapshot being written, or NULL */
    tsd_save_waiter *save_waiters; /* SAVEs for the next snapshot */
    uint64_t saved_version;        /* change counter of the last durable snapshot */
    int have_snapshot;             /* a snapshot file exists (loaded or written) */
    int final_pending;             /* shutdown: write the final snapshot after the running one */
    int save_failing;              /* the last snapshot failed (and none succeeded since) */
    int save_lock_fd;              /* PATH.lock, locked for the process's life; -1 = none */
    tsd_snap_job *draining;        /* written jobs whose references are being dropped */
    int signals_released;          /* tsd_server_release_signals ran */
    uv_idle_t *view_idle;          /* walks the views a chunk per loop turn, while any exist */
    uv_work_t pool_warm;           /* starts the thread pool with the exit signals blocked */
    uv_idle_t drain_idle;          /* drops them a slice per loop turn */
    int store_freed;
    int exit_code;
    tsd_store store;
    tsd_htab watches;
    /* Waiters (notify.c): the deadline heap, its timer, the wake queue and its idle handle. */
    tsd_waiter **wheap;
    size_t wheap_n, wheap_cap;
    uint64_t wait_seq;
    uv_timer_t *wait_timer; /* allocated while waiters exist */
    uv_idle_t *wake_idle;   /* allocated while watches are queued */
    tsd_watch *wake_head, *wake_tail;
    tsd_conn *conns; /* accepted, not yet closing */
    size_t n_conns;  /* clients in conns (refused ones on their way out excluded) */
    size_t n_unauth; /* of n_conns, those that have not completed HELLO */
    size_t n_alive;  /* connection objects not yet freed (closing ones included) */
    uint64_t next_conn_id;
    tsd_conn *dirty;  /* connections with a pending batch */
    uint64_t version; /* the change counter */
    uint64_t server_id;
    uint64_t start_ns;
    tsd_stats stats;
    int stopping;
    tsd_datadir *datadir; /* --data-dir state (datadir.c), or NULL */
    /* Streams (stream.c, stream.h): their table, waits and counters. */
    struct tsd_streams *streams;
    /* Replay tables (table.c, table.h): their table, waits and random state. */
    struct tsd_tables *tables;
    /* Coordination (coord.c): barriers and pending TAKEs, made on first use, or NULL. */
    struct tsd_coord *coord;
    /* The HTTP listener for health and metrics (http.c, http.h), or NULL. */
    struct tsd_http *http;
    /* The parameter server (ps.c): parameters, embedding tables, waits; on first use, or NULL. */
    struct tsd_ps *ps;
    /* Services (service.c, service.h): names, registrations, calls; on first use, or NULL. */
    struct tsd_services *services;
};

/*
 * Set up listeners, signals and the cron on loop, loading the snapshot first when configured.
 * 0 or a negative libuv/TS_E* code (srv->exit_code says which exit status fits).
 */
int tsd_server_init(tsd_server *srv, uv_loop_t *loop, const tsd_config *cfg);
/*
 * Start the graceful shutdown (what SIGINT/SIGTERM do): stop accepting and reading requests,
 * answer every request still waiting with SHUTTING_DOWN and tell every connection so
 * (tsd_conn_stop), write the final snapshot meanwhile, and close each connection once it has
 * read its last frames and closed, or after TSD_CLOSE_GRACE_MS.
 */
void tsd_server_stop(tsd_server *srv);
/*
 * After the loop has run out: close the signal handles (kept open while stopping, so that a
 * second signal cannot end the process during the final snapshot) and ignore those signals
 * until the process exits. Run the loop once more afterwards for the close callbacks.
 */
void tsd_server_release_signals(tsd_server *srv);
/* Free what remains after the loop has run out (store, tables). */
void tsd_server_free(tsd_server *srv);
/* The next value of the change counter. */
uint64_t tsd_server_next_version(tsd_server *srv);
/* Mark c as holding a pending batch. */
void tsd_server_mark_dirty(tsd_server *srv, tsd_conn *c);
/* Flush every pending batch (called at the end of each callback that produced output). */
void tsd_server_flush(tsd_server *srv);
void tsd_server_link_conn(tsd_server *srv, tsd_conn *c);
void tsd_server_unlink_conn(tsd_server *srv, tsd_conn *c);
/* A connection object was freed (the shutdown waits for the last one). */
void tsd_server_conn_freed(tsd_server *srv);
/* c could not get an input buffer: resume its reading shortly. */
void tsd_server_starve(tsd_server *srv, tsd_conn *c);
/* c's descriptor frame met a full socket: retry it after TSD_FD_RETRY_MS (tsd_out_fd_retry). */
void tsd_server_fd_blocked(tsd_server *srv, tsd_conn *c);
/* Forget c in the fd_blocked list (closing). */
void tsd_server_fd_unblock(tsd_server *srv, tsd_conn *c);
/* Free the store once (shutdown; after the final snapshot has its references). */
void tsd_server_free_store(tsd_server *srv);
/*
 * Write port to path atomically (a temporary file beside it, then rename), for --port-file and
 * --http-port-file. 0 or -1.
 */
int tsd_write_port_file(const char *path, int port);

#endif /* TSD_SERVER_H */
