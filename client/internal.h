/*
 * Internals of libtensorshare's client: the request, subscription and connection structures, and
 * the functions its files call across each other. The files: api.c (the public operations, on
 * the calling thread), client.c (ownership, deadlines, completion, the inbox, the I/O thread,
 * open and close), conn.c (connect, handshake, reconnect, resubscribe), send.c (frames and
 * writes), recv.c (reading and dispatching replies), direct.c (a blocking caller's own write and
 * read), reply.c (reply bodies into results, through src/msg.c), idmap.c and dlpack.c.
 *
 * Threads: a ts_client_t owns one I/O thread that runs its own libuv loop. Application threads
 * only touch the fields marked "under mu"; everything else belongs to the I/O thread. See
 * docs/THREADING.md for the full table.
 */
#ifndef TS_CLIENT_INTERNAL_H
#define TS_CLIENT_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include <uv.h>

#include "msg.h"
#include "proto.h"
#include "record.h"

/* ms; how often the I/O thread checks request deadlines */
#define TS__TICK_MS 20
/*
 * ms; a blocking caller waits this long past its deadline for the I/O thread's verdict before
 * abandoning the request on its own
 */
#define TS__BLOCK_GRACE_MS 500
#define TS__STAGE_SIZE     (64 << 10) /* bytes; the receive staging buffer of a connection */
#define TS__DIRECT_ID      0x80000000u /* request ids of direct writes have this bit; others do not */
#define TS__DIRECT_IOV     64          /* write buffers a direct write may use at most */

/*
 * The entry head of a STREAM_READ or STREAM_RANGE reply as reply.c keeps it (the wire head less
 * the record length, which the decoded record carries).
 */
typedef struct ts__stream_head {
    uint64_t id;
    uint64_t tag;        /* a marker's tag; 0 for a record */
    uint32_t rows_done;  /* rows of the entry a member recorded as consumed */
    uint16_t deliveries; /* times handed out, this one included (0 from a range) */
    uint8_t kind;        /* TS_STREAM_ENTRY_RECORD or TS_STREAM_ENTRY_MARKER */
    uint8_t flags;       /* TS_STREAM_ENTRY_REDELIVERED */
} ts__stream_head;

/* What follows the record pointers of an ENTRIES reply's ts_items_t (see below). */
typedef struct ts__stream_tail {
    uint64_t first_id; /* the oldest and newest ids the stream kept when it answered */
    uint64_t last_id;
    uint64_t lost; /* the group's (0 from a range) */
    ts__stream_head e[];
} ts__stream_tail;

/*
 * The items of a get or peek (reply.c builds them from ITEMS bodies, shm.c from by-reference
 * replies); ts_items_free frees each tree, which releases its buffer (a receive body or a
 * mapping).
 */
struct ts_items_s {
    size_t count;
    uint64_t version;
    uint32_t remaining;
    ts_value_t *items[]; /* decoded trees; each holds a reference on the receive buffer */
};

/*
 * An ENTRIES reply (STREAM_READ, STREAM_RANGE) is parsed into a ts_items_t too, so that every
 * path that frees a request's items (ts__req_free, a callback's end, the fuzz targets) frees it
 * without knowing streams: items[i] is entry i's decoded record (NULL for a marker), count the
 * entries decoded so far, remaining the reply's entry count n, and the same allocation holds a
 * ts__stream_tail with n heads right after items[n] (stream.c reads them through this).
 */
static inline ts__stream_tail *ts__items_stream_tail(ts_items_t *items)
{
    return (ts__stream_tail *)(void *)(items->items + items->remaining);
}

/*
 * An MGET reply is parsed the same way: items[] holds every found bin's records one bin after
 * the other (count of them), remaining is the number of bins n, and a ts__mget_head per bin
 * follows items[count] (coord.c splits them into one ts_items_t per bin).
 */
typedef struct ts__mget_head {
    uint64_t version;
    uint32_t n_items; /* records of this bin in items[] */
    uint32_t remaining;
    int found;
} ts__mget_head;

static inline ts__mget_head *ts__items_mget_heads(ts_items_t *items)
{
    return (ts__mget_head *)(void *)(items->items + items->count);
}

/*
 * A SAMPLES reply (TABLE_SAMPLE) is parsed the same way: items[i] is draw i's record, and a
 * ts__table_tail with n heads follows items[n] (replay.c reads them through this).
 */
typedef struct ts__table_head {
    uint64_t key;
    uint64_t age_ms;
    double probability;
    uint32_t times_sampled;
} ts__table_head;

typedef struct ts__table_tail {
    uint64_t size; /* the table's after the draw */
    ts__table_head e[];
} ts__table_tail;

static inline ts__table_tail *ts__items_table_tail(ts_items_t *items)
{
    return (ts__table_tail *)(void *)(items->items + items->remaining);
}

/* A map from request id to request (open addressing, linear probing; id 0 is never used). */
typedef struct ts__idmap {
    uint32_t *keys; /* 0 = free slot */
    void **vals;
    size_t cap; /* a power of two, or 0 */
    size_t n;
} ts__idmap;

/* Insert; the id must not be present. 0 or TS_ENOMEM. */
int ts__idmap_put(ts__idmap *m, uint32_t id, void *val);
/* The value for id, or NULL. */
void *ts__idmap_get(const ts__idmap *m, uint32_t id);
/* Remove id and return its value, or NULL when absent. */
void *ts__idmap_del(ts__idmap *m, uint32_t id);
void ts__idmap_free(ts__idmap *m);

/* Who is waiting for a request, which decides what completing it means. */
enum {
    TS__K_ASYNC = 1, /* a user callback */
    TS__K_BLOCK,     /* an application thread blocked on the request's condition variable */
    TS__K_HELLO,     /* the handshake of a connection */
    TS__K_RESUB,     /* a LISTEN re-sent for a subscription after a reconnect */
    TS__K_UNLISTEN,  /* ts_unlisten: final callback, then sent as TS__K_FIRE if connected */
    TS__K_FIRE,      /* an internal request whose reply is ignored */
    TS__K_SHARDMAP   /* a cluster's SHARD_MAP question to one shard (cluster.c) */
};

typedef struct ts__sub ts__sub;
typedef struct ts__conn ts__conn;

/*
 * One request. Created by the calling thread (which encodes the body), then handed to the I/O
 * thread through the inbox; from then on it belongs to the I/O thread, except for the fields a
 * blocking caller shares under mu.
 */
typedef struct ts__req {
    struct ts__req *next; /* inbox or wait-queue link */
    ts_client_t *c;
    int kind;
    uint8_t op;
    uint8_t hflags;       /* frame header flags (TS_FLAG_LZ4) */
    int borrowed;         /* the body points into caller memory (segments of enc) */
    uint64_t deadline_ns; /* monotonic; 0 = none */
    uint32_t id;          /* assigned when written (TS__DIRECT_ID set: written directly) */
    size_t woff; /* frame bytes a direct write already sent (the I/O thread sends the rest) */

    /*
     * The frame: small = header + fixed body part (a name and the fields after it: WAIT's 12
     * bytes, an upload's upload_fixed), then flat or the record plan.
     */
    uint8_t small[TS_HDR_SIZE + 1 + TS_MAX_NAME_LEN + TS_MSG_MAX_UPLOAD_FIXED];
    size_t small_len; /* body bytes in small after the header */
    uint8_t *flat;    /* ts__malloc_aligned body tail (copied record, lz4 body, token) */
    size_t flat_len;
    size_t flat_cap; /* the allocation size of flat */
    /* The record plan when the tensors are sent from caller memory (enc.head != NULL then). */
    ts__enc enc;
    uint64_t body_len;

    /* I/O thread state. */
    uv_write_t w;
    ts__conn *conn; /* the connection it was written to */
    int in_map;     /* registered in the in-flight map under id */
    int wstate;     /* TS__W_*: where its uv_write is */
    int status;

    /* Results (filled by the reply parser). */
    ts_result_t res;
    char *msg;      /* the server's error message (ts__malloc'd), or NULL */
    int have_state; /* res.version and res.n_items came from the server */
    uint8_t hello_flags;
    uint64_t hello_max_body;
    /* AUTH_CHALLENGE: the server's nonce; HELLO with TOKEN_PROOF granted: the server's proof. */
    uint8_t hello_proof[TS_MSG_TOKEN_PROOF_SIZE];
    /*
     * The fixed-size OK replies of the stream requests (reply.c; which member is set follows
     * from op: STREAM STATE, APPEND STATE, JOIN STATE or ACK STATE). Plain data: nothing to free.
     */
    union {
        ts__msg_add_state add;         /* ADD STATE (coord.c) */
        ts__msg_barrier_state barrier; /* BARRIER STATE (coord.c) */
        ts__msg_stream_state state;
        ts__msg_stream_append_state append;
        ts__msg_stream_join_state join;
        ts__msg_stream_ack_state ack;
        ts__msg_table_state table; /* TABLE STATE (replay.c) */
        ts__msg_svc_state svc;     /* SERVICE STATE (service.c) */
    } stream;

    /* Completion. */
    ts_result_cb cb;
    void *arg;
    ts__sub *sub; /* LISTEN, RESUB and UNLISTEN: the subscription (a reference) */

    /*
     * Blocking callers (kind TS__K_BLOCK, which alone has cond). bstate and wbusy under mu; the
     * transitions are in docs/THREADING.md ("A blocking request's states").
     */
    pthread_cond_t cond;
    int bstate; /* TS__B_*: who holds the request and whether it is finished */
    int wbusy;  /* the I/O thread may be reading the caller's memory (independent of bstate) */
    /* What a caller reading its own reply (TS__B_SELF_READ) needs, copied when it wrote. */
    int rfd;    /* the socket */
    int rblock; /* the socket was in blocking mode (see fd_blocking) */
    int rlz4;   /* the connection agreed on lz4 (a compressed reply is allowed) */

    /*
     * Clusters (cluster.c). A WRONG_SHARD reply's body (recv.c decodes it: have_ws, then the
     * slot, the owner's shard index, the daemon's map epoch and the owner's address, ts__malloc'd
     * or NULL when unknown), the redirects this request has taken, and a SHARD_MAP reply's map
     * (reply.c builds it; NULL for a daemon that is not sharded) and the answering daemon's index.
     */
    int have_ws;
    uint16_t ws_slot;
    uint16_t ws_owner;
    uint64_t ws_epoch;
    char *ws_addr;
    int redirects;
    struct ts__shard_map *shard_map;
    uint16_t shard_self;
} ts__req;

/* Where a request's write is (ts__req.wstate; I/O thread only). */
enum {
    TS__W_NONE = 0, /* no uv_write holds its frame */
    TS__W_PENDING,  /* uv_write has not called back yet: libuv may read the frame */
    TS__W_FINISH_CB /* completed meanwhile: the write callback finishes it */
};

/*
 * A blocking request's state (ts__req.bstate, under mu). Who moves it from which state to which
 * is the table in docs/THREADING.md; in short: the caller sets DIRECT or SELF_READ when it wrote
 * the frame itself, WITHDRAWN, ABANDONED_WAIT and ABANDONED when it gives up, and DONE when it
 * read its own reply; the I/O thread sets QUEUED when it takes a direct request over and DONE
 * when it completes one that the caller still waits for.
 */
enum {
    TS__B_QUEUED = 0,     /* the I/O thread's: inbox, wait queue, in flight, or handed off */
    TS__B_DIRECT,         /* written by the caller, waiting in c->direct; the I/O thread reads */
    TS__B_SELF_READ,      /* written by the caller, which holds the reading side for the reply */
    TS__B_DONE,           /* finished: status and results are the caller's, who frees it */
    TS__B_WITHDRAWN,      /* taken back out of c->direct at its deadline: the caller frees it */
    TS__B_ABANDONED_WAIT, /* given up, the caller waits for wbusy to clear: never freed under it */
    TS__B_ABANDONED       /* given up: the I/O thread frees it when it completes */
};
/* 1 when the caller gave r up (mu held). */
static inline int ts__req_abandoned_locked(const ts__req *r)
{
    return r->bstate == TS__B_ABANDONED || r->bstate == TS__B_ABANDONED_WAIT;
}

/* A subscription (ts_listen). */
struct ts__sub {
    ts__sub *next; /* c->subs, under mu */
    atomic_int refs;
    char *bin; /* NUL-terminated copy */
    size_t bin_len;
    ts_notify_cb cb;
    void *arg;
    int linked; /* in c->subs (under mu) */
    int live;   /* the server confirmed it once (under mu) */
    /* I/O thread only. */
    ts__sub *io_next; /* a temporary chain while delivering to several subscriptions */
    int on_conn;      /* subscribed on the current connection */
    int final_done;   /* the final callback was delivered */
    uint64_t version;
    uint32_t n_items;
};

/* Receive states of a connection. */
enum { TS__RS_HDR = 0, TS__RS_BODY };

/* One connection attempt or live connection; freed by its handle's close callback. */
struct ts__conn {
    union {
        uv_handle_t handle;
        uv_stream_t stream;
        uv_tcp_t tcp;
        uv_pipe_t pipe;
    } u;
    uv_connect_t connect;
    ts_client_t *c;
    int closing;
    int lz4;           /* compressed bodies agreed in HELLO */
    uint64_t max_body; /* the server's body limit from HELLO */
    /* The token proof's nonces: ours, then the server's (AUTH_CHALLENGE, section 4). */
    uint8_t auth_nonces[2 * TS_MSG_AUTH_NONCE_SIZE];
    struct ts__tls *tls; /* the TLS session on this connection (tls.c), or NULL: plain */
    /* Receiving. */
    uint8_t *stage;
    size_t stage_len;
    int rstate;
    ts__hdr hdr;
    uint8_t *body;
    size_t body_got;
    uint64_t discard; /* body bytes still to drop (a body we could not allocate) */
    /*
     * While the I/O thread is not reading (a blocking caller may read instead, see rd_owner),
     * a duplicate of the socket is watched for the peer's hang-up only.
     */
    uv_poll_t hup;
    int hup_fd;   /* -1 when there is no watcher */
    int hup_on;   /* the watcher is started */
    int hup_seen; /* it fired: the I/O thread reads on to the end of the stream */
    int handles;  /* libuv handles still open (the stream, the watcher); freed at 0 */
};

/* Connection states (I/O thread). */
enum {
    TS__ST_IDLE = 0,
    TS__ST_CONNECTING, /* resolving, connecting */
    TS__ST_HELLO,      /* connected, handshake in flight */
    TS__ST_READY,
    TS__ST_BACKOFF, /* waiting before the next attempt */
    TS__ST_CLOSED
};

/*
 * The descriptor lane (shm.c): a second unix connection that only the by-reference calls use,
 * one call at a time under mu, with blocking-style I/O on the calling thread (sendmsg/recvmsg
 * with SCM_RIGHTS and poll deadlines). The I/O thread never touches it.
 */
typedef struct ts__lane {
    pthread_mutex_t mu; /* held by a by-reference call from its first to its last lane I/O */
    int fd;             /* under mu; -1 while closed */
    /*
     * An eventfd that ts_client_free signals so that a call blocked in poll on the lane returns
     * TS_ECANCELED at once; -1 when it could not be made (such a call then ends at its deadline).
     * Set at open, read-only afterwards.
     */
    int wake_fd;
    uint32_t next_id;      /* under mu */
    uint64_t max_body;     /* under mu; the server's body limit from the lane's HELLO */
    uint64_t no_fds_until; /* under mu; monotonic ns: the server refused descriptors, copy */
} ts__lane;

struct ts_client_s {
    /* Set by ts_client_open, then read-only. */
    char *address; /* as given, for messages */
    char *host;
    int port;
    char *unix_path; /* non-NULL for a unix socket */
    ts_client_options_t opts;
    /*
     * 0 when TS_CLIENT_DIRECT=0 was in the environment at ts_client_open: blocking calls then
     * never write or read on the caller's thread (a benchmark switch, docs/PERFORMANCE.md). Read
     * once, so that reconnects do not call getenv, which is not thread-safe against setenv.
     */
    int direct_allowed;
    /* TLS (tls.c): on for "tls://" or the tls option; the context made at open, and the name
     * the server's certificate must carry. The direct path is off then (direct_allowed 0). */
    int tls;
    struct ssl_ctx_st *tls_ctx;
    char *tls_name;
    char *token;
    size_t token_len;
    pthread_t thread;

    ts__lane lane; /* the by-reference calls' own connection (shm.c) */

    /* Shared with application threads. */
    pthread_mutex_t mu;
    ts__req *inbox_head;               /* under mu */
    ts__req *inbox_tail;               /* under mu */
    ts__sub *subs;                     /* under mu */
    struct ts_service_s *svcs;         /* under mu: the services this client serves (service.c) */
    struct ts__svc_anchor *svc_anchor; /* under mu: what its calls hold of it (service.c) */
    atomic_uint svc_epoch; /* bumps with every connection that registers them (service.c) */
    int closing;           /* under mu: ts_client_free was called */
    int waiters;           /* under mu: blocking callers between submitting and returning */
    pthread_cond_t open_cond;
    int open_done;      /* under mu */
    int open_status;    /* under mu */
    char open_msg[256]; /* under mu */
    atomic_int connected;
    atomic_int lz4; /* the last handshake agreed on lz4 */
    pthread_condattr_t condattr;

    /*
     * Direct writes (all under mu): a blocking caller writes its own frame on the socket while
     * holding mu, when the connection is ready and the I/O thread has nothing being written
     * (see ts__submit_blocking_locked in direct.c).
     */
    int d_ready; /* the connection is ready: d_fd, d_max_body and d_lz4 are valid */
    int d_fd;
    int d_lz4;
    uint64_t d_max_body;
    unsigned io_writes; /* I/O thread writes started and not called back, plus inbox drains */
    uint32_t d_next_id;
    ts__idmap direct; /* requests written directly, by id, waiting for their reply */
    ts__req *handoff; /* a direct write the socket took only part of: the I/O thread ends it */
    /*
     * Who reads the socket (under mu): the I/O thread (TS__RD_IO), nobody (TS__RD_FREE: the
     * I/O thread had nothing to wait for and stopped reading) or one blocking caller reading its
     * own reply (TS__RD_CALLER). See "Reading replies on the calling thread" in direct.c.
     */
    int rd_owner;
    int rd_want; /* the I/O thread waits for a caller to hand the socket back */
    /*
     * While the I/O thread does not read, the socket is in blocking mode (with a short receive
     * timeout), so that a caller waits for its reply in recv itself rather than in poll first;
     * every write of the I/O thread and its own reading switch it back to non-blocking first.
     * Direct writes pass MSG_DONTWAIT and never block.
     */
    int fd_blocking;
    int rd_broken; /* 0, or why a caller gave up in the middle of a frame (a TS_E code): the
                      connection must go */
    /*
     * The receive buffer of the caller holding the reading side (TS__STAGE_SIZE bytes). What it
     * read that was not its reply (or came after it) stays at its start, pb_len bytes, for the
     * I/O thread, whose staging buffer is empty while it does not read.
     */
    uint8_t *pb;
    size_t pb_len;
    pthread_cond_t rd_cond; /* a caller handed the socket back */

    /*
     * Clusters (cluster.c), set before the I/O thread starts, then read-only. pub is the client
     * the user holds, which callbacks receive: c itself, or the cluster handle a shard client
     * belongs to. cl is non-NULL in a cluster handle only (it has no connection and no thread of
     * its own: every call is routed to a shard client). shard is non-NULL in a shard client: its
     * connection failures keep it reconnecting (never ending it, at open neither) and a request
     * made while it is down fails at once with TS_ENOTCONN.
     */
    ts_client_t *pub;
    struct ts__cluster *cl;
    struct ts__cluster_shard *shard;

    /* I/O thread only. */
    uv_loop_t loop;
    uv_async_t async;
    uv_timer_t tick;  /* request deadlines */
    uv_timer_t retry; /* connect timeout, then reconnect backoff */
    /*
     * Requests submitted on the I/O thread itself (from callbacks) are sent by this handle
     * before the loop next waits, instead of waking the loop through the async handle.
     */
    uv_prepare_t kick;
    int kicked;
    uv_prepare_t quiet; /* stops reading when nothing is awaited (see quiet_cb) */
    int reading;        /* uv_read_start is in effect on conn */
    int tick_on;
    ts__conn *conn;
    int state;
    int ever_ready;
    /*
     * "ADDRESS: reason" of the last failed connection or attempt ("" once connected again): what
     * a request that waited in vain for the connection says (tick_cb).
     */
    char down_msg[320];
    int free_on_exit; /* freed by the I/O thread itself (ts_client_free from a callback) */
    int backoff_ms;
    unsigned gen; /* bumps with every connection attempt */
    uint32_t next_id;
    ts__idmap inflight;
    ts__req *waitq_head;
    ts__req *waitq_tail;
};

/*
 * client.c: ownership, deadlines, completion, the inbox and the I/O thread.
 */
/* Hand a request to the I/O thread. 0, or TS_ECANCELED when the client is closing. */
int ts__submit(ts_client_t *c, ts__req *r);
/* The same with mu already held by the caller. */
int ts__submit_locked(ts_client_t *c, ts__req *r);
/* 1 when the calling thread is c's I/O thread (or, for a cluster, any of its shards'). */
int ts__on_io_thread(const ts_client_t *c);
/* 1 when the calling thread is exactly c's own I/O thread. */
int ts__io_thread_is(const ts_client_t *c);
/* Free a request and whatever results it still holds (any thread, once nobody else holds r). */
void ts__req_free(ts__req *r);
void ts__sub_unref(ts__sub *s);
/*
 * Complete a request with status (I/O thread): out of the in-flight map, then finished now, or
 * once its write has called back (libuv may still read the frame's memory until then).
 */
void ts__req_complete(ts_client_t *c, ts__req *r, int status);
/* Deliver a request's result to whoever waits for it, then release it (I/O thread). */
void ts__req_finish(ts_client_t *c, ts__req *r, int status);
/* Give r the message msg (NULL: none) for ts_last_error() in blocking calls and callbacks. */
void ts__req_set_msg(ts__req *r, const char *msg);
/* Finish every request of a list linked through next with err and the message msg (or NULL). */
void ts__fail_list(ts_client_t *c, ts__req *list, int err, const char *msg);
/* Fail every in-flight request with err and the message msg (or NULL), oldest first. */
void ts__fail_inflight(ts_client_t *c, int err, const char *msg);
/* Queue r until the connection is ready (I/O thread). */
void ts__append_waitq(ts_client_t *c, ts__req *r);
/* Make sure the deadline timer runs while requests are waiting or in flight. */
void ts__ensure_tick(ts_client_t *c);
/* Deliver a notification-shaped event, or the final callback (once), to a subscription. */
void ts__sub_event(ts_client_t *c, ts__sub *s, ts_event_t event, int coalesced);
void ts__sub_final(ts_client_t *c, ts__sub *s, int status);
/* Reverse a chain built through io_next (to deliver in subscription order). */
ts__sub *ts__sub_chain_reverse(ts__sub *s);
/* Close everything: pending requests get TS_ECANCELED, subscriptions their final callback. */
void ts__io_shutdown(ts_client_t *c);

/*
 * conn.c: connecting, the handshake, failing and reconnecting (I/O thread).
 */
/* Start one connection attempt, bounded by the connect timeout. */
void ts__start_attempt(ts_client_t *c);
/*
 * The connection (or the attempt to make one) failed: fail what is in flight, tell the
 * subscriptions, and schedule the next attempt. conn may be NULL while resolving.
 */
void ts__conn_fail(ts_client_t *c, ts__conn *conn, int err, const char *msg);
/*
 * ts__conn_fail, where server_reason says that err and msg are the server's own reason for
 * closing: the requests in flight then fail with err and carry msg.
 */
void ts__conn_fail_reason(ts_client_t *c, ts__conn *conn, int err, const char *msg,
                          int server_reason);
/* Close a connection; its memory goes in the close callbacks. */
void ts__conn_close(ts__conn *conn);
/* The HELLO request r of the current connection completed with status. */
void ts__hello_done(ts_client_t *c, ts__req *r, int status);
/* Split address into host/port or a unix path. 0, TS_EINVAL or TS_ENOMEM. */
int ts__parse_address(ts_client_t *c, const char *address);

/*
 * tls.c: TLS on the TCP connection. ts__client_tls_setup (at open, after the options): make
 * c->tls_ctx from opts when TLS is on; 0, or a TS_E code with the reason set (TS_ENOTSUP in a
 * build without TLS). ts__client_tls_free: free it (client teardown). ts__conn_tls_start: TLS
 * on conn, just connected (0 or TS_ENOMEM). The stream calls of a connection, through TLS
 * when conn->tls is set: the same contracts as uv_read_start, uv_write and uv_close.
 * ts__conn_tls_failed: 1 when conn's TLS session failed, with the TS_E code (TS_EAUTH for a
 * certificate that failed verification, else TS_EPROTO) and the reason. I/O thread.
 */
int ts__client_tls_setup(ts_client_t *c, const ts_client_options_t *opts);
void ts__client_tls_free(ts_client_t *c);
int ts__conn_tls_start(ts_client_t *c, ts__conn *conn);
int ts__conn_read_start(ts__conn *conn, uv_alloc_cb alloc_cb, uv_read_cb read_cb);
int ts__conn_write(ts__conn *conn, uv_write_t *req, const uv_buf_t *bufs, unsigned int n,
                   uv_write_cb cb);
void ts__conn_close_stream(ts__conn *conn, uv_close_cb cb);
int ts__conn_tls_failed(ts__conn *conn, int *err, const char **msg);

/*
 * send.c: frames and writes (I/O thread).
 */
/* Write r's frame on the current connection (or complete r with the error that prevents it). */
void ts__req_send(ts_client_t *c, ts__req *r);
/* Write n requests on the current connection with one uv_write (see send.c). */
void ts__req_send_batch(ts_client_t *c, ts__req **reqs, size_t n);
/*
 * Encode r's body (r->op set) into its small buffer through the codec: nothing for the empty
 * requests, the name and the fields of m that op's layout has, the head of PUT and APPEND (the
 * record follows from its own buffers). 0, or the encoder's error (TS_ENAMETOOLONG). Any thread.
 */
int ts__req_body(ts__req *r, const ts__msg_name_req *m);
/*
 * The fixed fields of an upload whose opcode has upload_fixed > 0, in the head ts__req_body
 * wrote (zeros until the caller writes them, before the request is submitted). Any thread.
 */
uint8_t *ts__req_upload_fixed(ts__req *r);
/* Send UNLISTEN for bin and ignore the answer (a listener nobody waits for any more). */
void ts__send_fire_unlisten(ts_client_t *c, const char *bin, size_t len);
/* Count a write of the I/O thread in io_writes (under mu), from before uv_write to its end. */
void ts__io_write_begin(ts_client_t *c);
void ts__io_write_end(ts_client_t *c);
/*
 * Start the uv_write of r's frame from bufs on conn (io_writes counts it already); when libuv
 * refuses, r completes with TS_ECONNRESET and the connection fails.
 */
void ts__req_write(ts_client_t *c, ts__conn *conn, ts__req *r, const uv_buf_t *bufs, size_t n);
/* The callback of a uv_write of one request (w->data is the request). */
void ts__write_cb(uv_write_t *w, int status);
/* Set r's request id and write its frame header into r->small. */
void ts__req_header(ts__req *r, uint32_t id);
/* Number of write buffers r's frame needs, and the buffers themselves (returns their count). */
size_t ts__req_nbufs(const ts__req *r);
size_t ts__req_fill_bufs(const ts__req *r, uv_buf_t *bufs);

/*
 * recv.c: reading and dispatching replies (I/O thread, except where said).
 */
/* Start reading conn into its staging buffer: 0, or -1 when the connection failed instead. */
int ts__read_start(ts_client_t *c, ts__conn *conn);
/* Parse every whole frame in the staging buffer; keep a partial one for the next read. */
void ts__process_stage(ts_client_t *c, ts__conn *conn);
/*
 * Check a reply header against what its opcode and status allow, before its body is read or
 * allocated; lz4 says whether the connection agreed on compressed bodies. 0 or TS_EPROTO. Any
 * thread: no system call, no allocation.
 */
int ts__reply_hdr_check(const ts_client_t *c, const ts__hdr *h, int lz4);
/*
 * Apply the reply frame h with body to r (its status, message and results); with owned, body is
 * an aligned allocation this takes over, otherwise it is borrowed. Returns the request's status;
 * *malformed when the frame broke the protocol. Touches nothing but r: any thread.
 */
int ts__reply_apply(ts__req *r, const ts__hdr *h, uint8_t *body, size_t len, int owned,
                    int *malformed);

/*
 * direct.c: the caller-side fast path of blocking calls, and the I/O thread's side of it.
 */
/*
 * Hand over a blocking request (mu held): written on the calling thread when the connection
 * allows it, else submitted like any other. Counts the caller in c->waiters. 0 or TS_ECANCELED.
 */
int ts__submit_blocking_locked(ts_client_t *c, ts__req *r);
/* Who reads the socket (ts_client_s.rd_owner). */
enum { TS__RD_IO = 0, TS__RD_FREE, TS__RD_CALLER };
/* What ts__self_read did. */
enum { TS__SELF_DONE = 0, TS__SELF_WAIT, TS__SELF_TIMEOUT };
/*
 * A blocking caller that was given the socket's reading side (r->self_read) reads its own reply:
 * TS__SELF_DONE with r->done and r->status set; TS__SELF_WAIT when the socket went back to the
 * I/O thread before the reply came (wait for it as usual); TS__SELF_TIMEOUT when the deadline
 * passed (r was taken back from c->direct and is the caller's to free).
 */
int ts__self_read(ts_client_t *c, ts__req *r);
/*
 * At its deadline, a caller takes its request back out of c->direct (mu held): 1 when r was
 * waiting there (it is TS__B_WITHDRAWN now, the caller's to free; a late reply finds nothing),
 * 0 when the I/O thread had taken it over already.
 */
int ts__direct_withdraw_locked(ts_client_t *c, ts__req *r);
/*
 * Stop direct writes before the socket closes (I/O thread). Returns the requests direct writes
 * left waiting, for ts__fail_list.
 */
ts__req *ts__direct_stop(ts_client_t *c);
/* The direct request waiting for the reply with this id, taken out of c->direct; or NULL. */
ts__req *ts__direct_take(ts_client_t *c, uint32_t id);
/* Finish a direct write the socket took only part of (I/O thread; io_writes counts it). */
void ts__write_handoff(ts_client_t *c, ts__req *r);
/* A caller gave up in the middle of a frame (rd_broken holds why): end the connection. */
void ts__conn_fail_broken(ts_client_t *c, int why);
/* The I/O thread reads the socket again (it holds the reading side). */
void ts__start_reading(ts_client_t *c);
/* The I/O thread has something to wait for: get the reading side back, now or from the caller. */
void ts__io_want_read(ts_client_t *c);
/* Before the loop waits: stop reading when nothing is awaited. */
void ts__quiet_cb(uv_prepare_t *p);
/* Put the socket in blocking mode or back (I/O thread; see fd_blocking). */
void ts__fd_set_blocking(ts_client_t *c, int on);

/*
 * shm.c: the descriptor lane. init at ts_client_open (after mu is made); cancel when the client
 * is being freed, before waiting for blocking callers; destroy when nobody uses the client.
 */
void ts__lane_init(ts_client_t *c);
void ts__lane_cancel(ts_client_t *c);
void ts__lane_destroy(ts_client_t *c);

/*
 * api.c's request machinery, for operation files beside it (rows.c): the call checks of every
 * operation (TS_EDEADLK for a blocking call on the I/O thread); a request for op on bin whose
 * body ts__req_body encodes with no arguments (NULL and *rc on failure, its message set); running
 * a blocking request to the end (0 with *out the completed request, which the caller frees); and
 * submitting an asynchronous one (on failure r is freed and cb never called).
 */
int ts__api_check_call(ts_client_t *c, int blocking);
ts__req *ts__api_req_new(ts_client_t *c, int kind, uint8_t op, const char *bin, int *rc);
int ts__api_run_blocking(ts_client_t *c, ts__req *r, ts__req **out);
/* The wire form of an operation's wait of timeout_ms into *wire: 0, or TS_EINVAL with the
 * message set (api.c; tensorshare.h "Timeouts"). Any thread. */
int ts__wire_timeout(const ts_client_t *c, int timeout_ms, uint32_t *wire);
/* The name check of stream.c and replay.c (api.c): 0 and *len, or the error, its message set. */
int ts__api_check_id(const char *what, const char *s, size_t *len);
/*
 * The INFO call of a stream or a replay table (op STREAM_INFO or TABLE_INFO, what "stream" or
 * "table" for the messages): a blocking request on name whose reply value is handed to *out
 * (transferred). 0, or the error with its message set.
 */
int ts__api_info(ts_client_t *c, uint8_t op, const char *what, const char *name, ts_value_t **out);
/*
 * Attach item's record to r, an upload whose head r's small buffer holds, sent from the caller's
 * memory as it is: a blocking STREAM_APPEND's or TABLE_INSERT's, never copied or compressed. 0, or
 * the encoding error with its message set and r freed.
 */
int ts__api_borrow_record(ts__req *r, const ts_value_t *item);
/* Encodes a request body from ctx into out (cap bytes): 0 and *len, or an error code. */
typedef int (*ts__flat_enc)(uint8_t *out, size_t cap, const void *ctx, size_t *len);
/*
 * A request of kind (TS__K_BLOCK, ...) for op whose whole body lies in a fresh buffer of cap
 * bytes, r->flat: what encode wrote there from ctx, or, with encode NULL, cap bytes the caller
 * writes before running it. A request the server may hold for wait_ms (a wait sent on the wire)
 * gets that much more time than the request timeout (ts__req_hold_for). NULL and *rc on failure,
 * the message set. One copy for the operation files whose bodies have no record (api.c).
 */
ts__req *ts__api_flat_req(ts_client_t *c, int kind, uint8_t op, size_t cap, ts__flat_enc encode,
                          const void *ctx, uint32_t wait_ms, int *rc);
/* Give r, which the server may hold for wait_ms, that much more time than the request timeout. */
void ts__req_hold_for(const ts_client_t *c, ts__req *r, uint32_t wait_ms);
/*
 * Attach item as the record of r, an upload whose head (name and fixed fields) r's small buffer
 * holds: sent from the caller's memory (TS_BORROW), copied (TS_COPY), or the whole body as one
 * LZ4 block when the client compresses and the server agreed. 0, or TS_ENOMEM / an encoding
 * error (r is unchanged then).
 */
int ts__api_attach_record(ts_client_t *c, ts__req *r, const ts_value_t *item, unsigned flags);
int ts__api_run_async(ts_client_t *c, ts__req *r, ts_result_cb cb, void *arg);

/*
 * api.c, for cluster.c: the caller's half of a blocking request on a shard client (submit, wait;
 * *gone when r was given up and belongs to the I/O thread), and the redirecting loop that
 * ts__api_run_blocking runs for a shard client.
 */
int ts__api_block_on(ts_client_t *c, ts__req *r, int *gone);
/*
 * Run n blocking requests at once: rs[i] on cs[i], all submitted through the inboxes before any
 * is waited for. rcs[i] gets each status; rs[i] stays the caller's to read and free, or is set to
 * NULL when it was freed (a failed submission) or given up (the I/O thread frees it).
 */
void ts__api_run_blocking_all(ts_client_t *const *cs, ts__req **rs, size_t n, int *rcs);

/*
 * cluster.c: the cluster client (docs/CLUSTER.md). A cluster handle holds one ordinary client
 * per shard and routes every call that names a bin to the shard that owns the name's slot.
 */
/* 1 when address names a cluster: a comma-separated list, or "cluster:PATH". */
int ts__cluster_address(const char *address);
/* ts_client_open for a cluster address. */
int ts__cluster_open(ts_client_t **out, const char *address, const ts_client_options_t *opts);
/* ts_client_free and ts_client_connected of a cluster handle. */
void ts__cluster_free(ts_client_t *h);
/*
 * Free a cluster handle whose shard clients have all stopped (their threads joined, or the
 * calling one about to end): waits for callers still inside, then frees every shard client.
 */
void ts__cluster_destroy(ts_client_t *h);
int ts__cluster_connected(ts_client_t *h);
/* The shard client that owns name's slot (name NULL: any shard; the caller's checks follow). */
ts_client_t *ts__cluster_route(ts_client_t *h, const char *name);
/* The shard client that owns slot (below TS_SLOTS), for calls spread by id (ps.c). */
ts_client_t *ts__cluster_route_slot(ts_client_t *h, uint16_t slot);
/*
 * The shard clients of cluster handle h that own at least one slot, each once, in the order the
 * handle made them (the map's order first) into cs (TS_SHARD_MAX entries); returns how many.
 */
size_t ts__cluster_shard_clients(ts_client_t *h, ts_client_t **cs);
/* The client a call naming name goes to: c itself, or for a cluster handle its shard client. */
static inline ts_client_t *ts__route(ts_client_t *c, const char *name)
{
    return c != NULL && c->cl != NULL ? ts__cluster_route(c, name) : c;
}
/*
 * Run a blocking request on shard client c, following WRONG_SHARD redirects (at most
 * TS__CLUSTER_REDIRECTS). As ts__api_block_on.
 */
int ts__cluster_block(ts_client_t *c, ts__req *r, int *gone);
/*
 * An asynchronous request on shard client c got WRONG_SHARD (I/O thread): 1 when it was handed
 * to the owner (its callback comes from there), 0 when it finishes here with the error.
 */
int ts__cluster_redirect_async(ts_client_t *c, ts__req *r);
/* A SHARD_MAP question (TS__K_SHARDMAP) completed with status (I/O thread). */
void ts__cluster_map_done(ts_client_t *c, ts__req *r, int status);
/*
 * Shard client c: its connection became ready (I/O thread; asks the daemon for its map), or
 * failed (every request waiting for it fails with TS_ENOTCONN, and the first failure at open
 * is reported to the opening thread without ending the client).
 */
void ts__cluster_shard_ready(ts_client_t *c);
void ts__cluster_shard_failed(ts_client_t *c, int err, const char *msg);
/* 1 when a request made on shard client c now must fail at once (I/O thread), and the message. */
int ts__cluster_shard_down(ts_client_t *c, const char **msg);
/*
 * After WRONG_SHARD on shard client c for request r (with have_ws): learn where r's slot
 * belongs and return the shard client to try next, or NULL (no redirect possible). Any thread.
 */
ts_client_t *ts__cluster_learn(ts_client_t *c, ts__req *r);
/*
 * A call on cluster handle h that may move between shard clients holds h open: 0, or
 * TS_ECANCELED once ts_client_free was called. Every enter is paired with a leave.
 */
int ts__cluster_enter(ts_client_t *h);
void ts__cluster_leave(ts_client_t *h);
/* Redirects one request follows at most before its WRONG_SHARD reaches the caller. */
#define TS__CLUSTER_REDIRECTS 3
/* The blocking fan-outs of a cluster handle (LIST, STATS, PING, SAVE) and MGET. */
int ts__cluster_list(ts_client_t *h, ts_bin_list_t **out);
int ts__cluster_stats(ts_client_t *h, ts_value_t **out);
int ts__cluster_each(ts_client_t *h, uint8_t op);
int ts__cluster_mget(ts_client_t *h, const char *const *names, size_t n, size_t max_items,
                     ts_items_t **out);
/* The asynchronous fan-outs (LIST, STATS, PING): one callback with the merged result. */
int ts__cluster_fanout_async(ts_client_t *h, uint8_t op, ts_result_cb cb, void *arg);

/*
 * client.c, for cluster.c: start a client for one address (its I/O thread connecting; pub and
 * shard set before it starts), wait for its first connection's verdict, ask it to close, join
 * its thread, and free it.
 */
int ts__client_start(ts_client_t **out, const char *address, const ts_client_options_t *opts,
                     ts_client_t *pub, struct ts__cluster_shard *shard);
int ts__client_wait_open(ts_client_t *c, char *msg, size_t cap);
void ts__client_stop(ts_client_t *c);
void ts__client_join(ts_client_t *c);
void ts__client_destroy(ts_client_t *c);
/* Set up a cluster handle's options (the same defaults and checks as a client's). */
int ts__client_setup_options(ts_client_t *c, const ts_client_options_t *opts);

/* lasterror.c: set the thread's ts_last_error() to len bytes of msg (NULL: ""). */
void ts__set_last_error(const char *msg, size_t len);

/* reply.c: parse a reply body for r (status already OK); takes over body. 0 or TS_EPROTO. */
int ts__reply_parse(ts__req *r, uint8_t *body, size_t len);
/*
 * 1 when the reply to op keeps its body (the decoded tensors point into it: GET, PEEK, STATS),
 * so the body must be an aligned allocation handed to ts__reply_parse.
 */
int ts__reply_keeps_body(uint8_t op);
/*
 * Parse the reply body of any other op for r, reading body without taking it over (it may lie
 * in the receive staging buffer). 0, TS_EPROTO or TS_ENOMEM.
 */
int ts__reply_parse_view(ts__req *r, const uint8_t *body, size_t len);
/*
 * Parse a bin state body into r->res (version, n_items) and set r->have_state: the OK reply of
 * PUT, APPEND, DELETE, LISTEN and WAIT, and WAIT's TIMEOUT. 0 or TS_EPROTO.
 */
int ts__reply_bin_state(ts__req *r, const uint8_t *body, size_t len);
/*
 * Decode a WRONG_SHARD body into r (have_ws, ws_*, and the message into r->msg). 0 or TS_EPROTO.
 */
int ts__reply_wrong_shard(ts__req *r, const uint8_t *body, size_t len);
/* Free an aligned receive body. */
void ts__body_free(uint8_t *body, size_t len);

/*
 * service.c, for recv.c, conn.c and client.c (I/O thread): hand an SVC_REQUEST push to its
 * registration's callback (body owned as dispatch's; 0, or TS_EPROTO for a malformed body), send
 * SVC_REGISTER again for every registration on a fresh connection, and drop the registrations
 * when the client closes.
 */
int ts__svc_push(ts_client_t *c, uint8_t *body, size_t len, int owned);
void ts__svc_reregister(ts_client_t *c);
void ts__svc_close(ts_client_t *c);

#endif /* TS_CLIENT_INTERNAL_H */
