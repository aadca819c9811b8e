/*
 * The output queue of a connection: write batches, emergency frames, the output limits (the
 * slow-reader cut-off), replies and error replies, and handing batches to the socket. The request
 * handlers (ops.c), the notifications (notify.c) and the read state machine (conn.c) queue their
 * frames here; every body is encoded by src/msg.c.
 *
 * Replies are appended to a pending batch: small bytes in one growing buffer, item buffers by
 * reference (no copy, the batch holds a reference until the write callback). The batch is handed
 * to uv_write once the callback that produced it is done, so a pipeline of small requests costs
 * one write.
 */
#include "server.h"

#include "msg.h"

#include <errno.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

static void write_pending(tsd_conn *c);
static void fdq_drain(tsd_conn *c);
static struct tsd_wbatch *fdq_pop(tsd_conn *c);
static void on_write(uv_write_t *req, int status);
static void batch_failed(tsd_conn *c, struct tsd_wbatch *b, int rc);

/* Write the header of a reply (or notification) frame at p (TS_HDR_SIZE bytes). */
static void put_reply_hdr(uint8_t *p, uint8_t op, uint32_t rid, uint16_t status, uint64_t body_len)
{
    ts__hdr h = {.magic = TS_MAGIC_REP,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .status = status,
                 .request_id = rid,
                 .body_len = body_len};
    ts__hdr_encode(&h, p);
}

/* uv_bufs a descriptor batch's sendmsg takes at once (the rest follows through libuv). */
#define TSD_SENDMSG_IOV 64

/* Bytes; the first capacity of a batch's buffer of small bytes (it doubles as needed). */
#define TSD_SMALL_MIN 256

/* ---------------------------------------------------------------------------------------------
 * Write batches
 */

/* Bytes of the allocations of b: its struct and each array at its capacity. */
static uint64_t batch_cost(const tsd_wbatch *b)
{
    return sizeof(*b) + b->small_cap + b->segs_cap * sizeof(*b->segs) +
           b->items_cap * sizeof(*b->items) + b->bufs_cap * sizeof(*b->bufs);
}

/*
 * Bring b's counted cost up to date after its arrays changed: the connection's out_mem (b is
 * queued or in flight) and the store's output total both follow.
 */
static void batch_account(tsd_conn *c, tsd_wbatch *b)
{
    uint64_t now = batch_cost(b);
    c->out_mem = c->out_mem - b->cost + now;
    c->srv->store.output = c->srv->store.output - b->cost + now;
    b->cost = now;
}

static void batch_free(tsd_conn *c, tsd_wbatch *b)
{
    c->srv->store.output -= b->cost;
    ts__free(b->small);
    ts__free(b->segs);
    ts__free(b->items);
    ts__free(b->bufs);
    ts__free(b);
}

/* Close the descriptors from the first keep on that the batch owns, and forget them. */
static void batch_drop_fds(tsd_wbatch *b, uint32_t keep)
{
    for (uint32_t i = keep; i < b->nfds; i++)
        if (b->fd_owned[i])
            (void)close(b->fds[i]);
    b->nfds = keep;
}

/* Drop the batch's item references and keep it for reuse (or free it). */
static void batch_release(tsd_conn *c, tsd_wbatch *b)
{
    batch_drop_fds(b, 0);
    for (size_t i = 0; i < b->nitems; i++)
        tsd_item_unref(b->items[i]);
    b->nitems = 0;
    b->nsegs = 0;
    b->nbufs = 0;
    b->small_len = 0;
    b->bytes = 0;
    /* A kept batch still counts in the store's total, no longer in the connection's queue. */
    c->out_mem -= b->cost;
    if (c->n_cached < TSD_BATCH_CACHE && b->small_cap <= ((size_t)1 << 20)) {
        b->next_free = c->batch_cache;
        c->batch_cache = b;
        c->n_cached++;
    } else {
        batch_free(c, b);
    }
}

/* The pending batch, created when missing; NULL on allocation failure. */
static tsd_wbatch *pending(tsd_conn *c)
{
    if (c->pend != NULL)
        return c->pend;
    tsd_wbatch *b = c->batch_cache;
    if (b != NULL) {
        c->batch_cache = b->next_free;
        c->n_cached--;
        b->next_free = NULL;
    } else {
        b = ts__calloc(1, sizeof(*b));
        if (b == NULL)
            return NULL;
        b->cost = sizeof(*b);
        c->srv->store.output += b->cost;
    }
    c->out_mem += b->cost;
    b->conn = c;
    c->pend = b;
    tsd_server_mark_dirty(c->srv, c);
    return b;
}

/* Grow an array of elem-sized entries to hold at least need entries. 0 or -1. */
static int grow(void **arr, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    /* Small first sizes: a notification batch holds one segment and one buffer. */
    size_t n = *cap < 4 ? 4 : *cap;
    while (n < need)
        n *= 2;
    void *p = ts__realloc(*arr, n * elem);
    if (p == NULL)
        return -1;
    *arr = p;
    *cap = n;
    return 0;
}

/*
 * Stop serving c: no more requests are read (input is drained and dropped, so closing does not
 * reset the connection and destroy the last reply), no more output is accepted, and the
 * connection closes once its queued writes are done and the peer has seen our FIN (or at the
 * deadline, for peers that never read).
 */
void tsd_conn_begin_closing(tsd_conn *c)
{
    c->out_blocked = 1;
    if (!c->close_after_flush) {
        c->close_after_flush = 1;
        c->close_deadline = uv_now(c->srv->loop) + TSD_CLOSE_GRACE_MS;
    }
    c->rstate = TSD_RS_DEAD;
    tsd_conn_fds_close(c); /* no later frame can claim them */
    tsd_server_mark_dirty(c->srv, c);
}

static void on_emerg_write(uv_write_t *req, int status)
{
    tsd_emerg *e = (tsd_emerg *)req;
    tsd_conn *c = req->data;
    e->busy = 0;
    c->writes_in_flight--;
    if (status == 0)
        c->srv->stats.bytes_sent += e->buf.len;
    if (c->closing)
        return;
    if (status < 0) {
        tsd_conn_close(c);
        return;
    }
    if (c->fdq_head != NULL && c->writes_in_flight == 0) {
        fdq_drain(c);
        if (c->closing)
            return;
    }
    tsd_conn_maybe_finish(c);
}

/*
 * Send a frame without allocating: the replies queued before it are handed to the socket first
 * (so the order on the wire is kept), then the frame is written from a free emergency slot.
 * body is cut to TSD_EMERG_MSG bytes. 0, or -1 when every slot is busy or the write failed.
 */
static int emerg_send(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const void *body,
                      size_t len)
{
    if (c->closing)
        return -1;
    tsd_emerg *e = NULL;
    for (int i = 0; i < TSD_EMERG_FRAMES && e == NULL; i++)
        if (!c->emerg[i].busy)
            e = &c->emerg[i];
    if (e == NULL)
        return -1;
    write_pending(c);
    /*
     * An emergency frame has no batch, so it cannot wait in fdq: the batches waiting there for
     * the write in flight are handed to libuv first, so that it goes after them. Frames waiting
     * behind a descriptor frame cannot be overtaken, so there is no room for it then (the caller
     * closes).
     */
    for (const tsd_wbatch *w = c->fdq_head; w != NULL; w = w->fdq_next)
        if (w->nfds > 0)
            return -1;
    while (c->fdq_head != NULL && !c->closing) {
        tsd_wbatch *w = fdq_pop(c);
        w->req.data = w;
        int rc = tsd_stream_write(c, &w->req, w->bufs, (unsigned int)w->nk, on_write);
        if (rc != 0) {
            batch_failed(c, w, rc);
            return -1;
        }
        c->writes_in_flight++;
    }
    if (c->closing || (c->close_deadline == 0 && c->close_after_flush))
        return -1; /* the write failed: the peer is gone */
    if (len > TSD_EMERG_MSG)
        len = TSD_EMERG_MSG;
    put_reply_hdr(e->frame, op, rid, status, len);
    if (len > 0)
        memcpy(e->frame + TS_HDR_SIZE, body, len);
    e->buf = uv_buf_init((char *)e->frame, (unsigned int)(TS_HDR_SIZE + len));
    e->req.data = c;
    if (tsd_stream_write(c, &e->req, &e->buf, 1, on_emerg_write) != 0)
        return -1;
    e->busy = 1;
    c->writes_in_flight++;
    return 0;
}

/* Remember where the pending batch stands: a reply for (op, rid) begins. */
static void out_mark(tsd_conn *c, uint8_t op, uint32_t rid)
{
    tsd_wbatch *b = c->pend;
    c->mk.active = 1;
    c->mk.failed = 0;
    c->mk.op = op;
    c->mk.rid = rid;
    c->mk.status = TS_ST_OK;
    c->mk.body = NULL;
    c->mk.had_pend = b != NULL;
    if (b != NULL) {
        c->mk.small_len = b->small_len;
        c->mk.nsegs = b->nsegs;
        c->mk.last_len = b->nsegs > 0 ? b->segs[b->nsegs - 1].len : 0;
        c->mk.nitems = b->nitems;
        c->mk.nbufs = b->nbufs;
        c->mk.bytes = b->bytes;
        c->mk.nfds = b->nfds;
    }
}

/*
 * Output failed for lack of memory. The reply being queued is taken back whole (the pending
 * batch returns to where it stood when the reply began, so no half frame is ever sent) and
 * goes out through an emergency slot instead: as it was when it is a small tsd_reply (so a
 * change that happened is never reported as failed), else as an OUT_OF_MEMORY error (only
 * replies that changed nothing are that large). The connection carries on; only when no slot
 * is free is it closed.
 */
static void out_abort(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    if (c->mk.failed)
        return;
    c->mk.failed = 1;
    srv->stats.out_of_memory++;
    tsd_wbatch *b = c->pend;
    if (b != NULL) {
        if (!c->mk.active || !c->mk.had_pend) {
            batch_release(c, b);
            c->pend = NULL;
        } else {
            for (size_t i = c->mk.nitems; i < b->nitems; i++)
                tsd_item_unref(b->items[i]);
            b->nitems = c->mk.nitems;
            b->small_len = c->mk.small_len;
            b->nsegs = c->mk.nsegs;
            if (b->nsegs > 0)
                b->segs[b->nsegs - 1].len = c->mk.last_len;
            b->nbufs = c->mk.nbufs;
            b->bytes = c->mk.bytes;
            batch_drop_fds(b, c->mk.nfds);
        }
    }
    if (!c->mk.active || c->mk.op == TS_OP_NOTIFY || c->mk.op == TS_OP_SVC_REQUEST || c->mk.op == 0)
        return; /* A notification or a pushed call is its caller's to retry; connection-level
                 * frames just go. */
    int rc;
    if (c->mk.body != NULL && (c->mk.body_len <= TSD_EMERG_MSG || c->mk.body_status != 0)) {
        /* The reply itself (an error message may be cut short). */
        rc = emerg_send(c, c->mk.op, c->mk.rid, c->mk.body_status, c->mk.body, c->mk.body_len);
    } else {
        static const char msg[] = "tensord is out of memory";
        tsd_log(TSD_LOG_WARN, "conn %llu: out of memory queueing a %s reply; sent %s instead",
                (unsigned long long)c->id, ts__op_name(c->mk.op),
                ts__status_name(TS_ST_OUT_OF_MEMORY));
        rc = emerg_send(c, c->mk.op, c->mk.rid, TS_ST_OUT_OF_MEMORY, msg, sizeof(msg) - 1);
        srv->stats.errors[TS_ST_OUT_OF_MEMORY]++;
    }
    c->mk.body = NULL;
    if (rc != 0) {
        tsd_log(TSD_LOG_WARN, "conn %llu: no room for an error frame either, closing",
                (unsigned long long)c->id);
        tsd_conn_begin_closing(c);
        c->close_deadline = 0;
    }
}

/* uv_bufs needed for len bytes (write_pending cuts long runs into write chunks). */
static size_t nchunks(size_t len)
{
    return (len + TSD_WRITE_CHUNK - 1) / TSD_WRITE_CHUNK;
}

/* Append a segment; ptr == NULL refers to small bytes at off. 0 or -1. */
static int add_seg(tsd_wbatch *b, const uint8_t *ptr, size_t off, size_t len)
{
    /* The uv_buf array grows here too, so that writing the batch never allocates. */
    if (ptr == NULL && b->nsegs > 0) {
        tsd_wseg *last = &b->segs[b->nsegs - 1];
        if (last->ptr == NULL && last->off + last->len == off) {
            size_t extra = nchunks(last->len + len) - nchunks(last->len);
            if (grow((void **)&b->bufs, &b->bufs_cap, b->nbufs + extra, sizeof(*b->bufs)) != 0)
                return -1;
            last->len += len;
            b->nbufs += extra;
            return 0;
        }
    }
    if (grow((void **)&b->segs, &b->segs_cap, b->nsegs + 1, sizeof(*b->segs)) != 0 ||
        grow((void **)&b->bufs, &b->bufs_cap, b->nbufs + nchunks(len), sizeof(*b->bufs)) != 0)
        return -1;
    b->segs[b->nsegs++] = (tsd_wseg){.ptr = ptr, .off = off, .len = len};
    b->nbufs += nchunks(len);
    return 0;
}

uint8_t *tsd_out_bytes(tsd_conn *c, size_t n)
{
    if (c->mk.failed)
        return NULL;
    tsd_wbatch *b = pending(c);
    if (b == NULL)
        goto fail;
    if (b->small_len + n > b->small_cap) {
        /*
         * Start small: a listener that never reads holds one batch per notification, and each
         * batch's buffer counts against its output limit at its capacity.
         */
        size_t cap = b->small_cap < TSD_SMALL_MIN ? TSD_SMALL_MIN : b->small_cap;
        while (cap < b->small_len + n)
            cap *= 2;
        uint8_t *p = ts__realloc(b->small, cap);
        if (p == NULL)
            goto fail;
        b->small = p;
        b->small_cap = cap;
    }
    int seg_rc = add_seg(b, NULL, b->small_len, n);
    batch_account(c, b);
    if (seg_rc != 0)
        goto fail;
    uint8_t *p = b->small + b->small_len;
    b->small_len += n;
    b->bytes += n;
    return p;
fail:
    out_abort(c);
    return NULL;
}

/*
 * Keep it (a reference the caller took) in the pending batch until the batch is written. The
 * batch, or NULL when it cannot be had or grown: the reference is dropped and the output aborted.
 */
static tsd_wbatch *batch_keep(tsd_conn *c, tsd_item *it)
{
    tsd_wbatch *b = pending(c);
    if (b == NULL ||
        grow((void **)&b->items, &b->items_cap, b->nitems + 1, sizeof(*b->items)) != 0) {
        if (b != NULL)
            batch_account(c, b);
        tsd_item_unref(it);
        out_abort(c);
        return NULL;
    }
    b->items[b->nitems++] = it;
    return b;
}

int tsd_out_item(tsd_conn *c, tsd_item *it, int ref)
{
    if (ref)
        tsd_item_ref(it);
    if (c->mk.failed) {
        tsd_item_unref(it);
        return -1;
    }
    tsd_wbatch *b = batch_keep(c, it);
    if (b == NULL)
        return -1;
    /* Large items go out as several bounded buffers, so one write never pins a huge region. */
    uint8_t *data = tsd_item_data(it);
    size_t len = tsd_item_len(it);
    for (size_t off = 0; off < len; off += TSD_WRITE_CHUNK) {
        size_t n = len - off < TSD_WRITE_CHUNK ? len - off : TSD_WRITE_CHUNK;
        if (add_seg(b, data + off, 0, n) != 0) {
            batch_account(c, b);
            out_abort(c);
            return -1;
        }
    }
    batch_account(c, b);
    b->bytes += len;
    size_t pad = ts__msg_items_pad(len);
    if (pad > 0) {
        uint8_t *p = tsd_out_bytes(c, pad);
        if (p == NULL)
            return -1;
        memset(p, 0, pad);
    }
    return 0;
}

int tsd_out_hold(tsd_conn *c, tsd_item *it)
{
    tsd_item_ref(it);
    if (c->mk.failed) {
        tsd_item_unref(it);
        out_abort(c);
        return -1;
    }
    tsd_wbatch *b = batch_keep(c, it);
    if (b == NULL)
        return -1;
    batch_account(c, b);
    return 0;
}

int tsd_out_hdr(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t body_len)
{
    c->mk.status = status;
    if (status != TS_ST_OK && status < TSD_STATUS_SLOTS)
        c->srv->stats.errors[status]++; /* the metrics' errors by status */
    uint8_t *p = tsd_out_bytes(c, TS_HDR_SIZE);
    if (p == NULL)
        return -1;
    put_reply_hdr(p, op, rid, status, body_len);
    return 0;
}

/*
 * The connection reads slower than it asks: drop what is not yet handed to the socket (the
 * pending batch and those waiting in fdq: all but the one write in flight, see batch_go), tell
 * it why once that write is done, and close it once that is written (or after the grace period).
 */
static void cut_off_slow_reader(tsd_conn *c, uint64_t queued, int soft)
{
    tsd_server *srv = c->srv;
    const tsd_config *cfg = &srv->cfg;
    srv->stats.slow_readers++;
    char msg[160];
    if (soft)
        snprintf(msg, sizeof(msg),
                 "output over the soft limit of %llu bytes for %u s: reading too slowly",
                 (unsigned long long)cfg->output_soft, cfg->output_soft_seconds);
    else
        snprintf(msg, sizeof(msg), "output limit of %llu bytes exceeded: reading too slowly",
                 (unsigned long long)cfg->max_output);
    tsd_log(TSD_LOG_WARN, "conn %llu: %llu bytes of output queued, cutting it off: %s",
            (unsigned long long)c->id, (unsigned long long)queued, msg);
    if (c->pend != NULL) {
        batch_release(c, c->pend);
        c->pend = NULL;
    }
    /* Batches waiting behind a descriptor frame are unwritten too: dropped with it. */
    while (c->fdq_head != NULL)
        batch_release(c, fdq_pop(c));
    tsd_server_fd_unblock(srv, c);
    out_mark(c, 0, 0);
    size_t n = strlen(msg);
    if (tsd_out_hdr(c, 0, 0, TS_ST_SLOW_READER, n) == 0) {
        uint8_t *p = tsd_out_bytes(c, n);
        size_t len;
        if (p != NULL)
            (void)ts__msg_error_encode(p, n, msg, n, &len);
    }
    c->mk.active = 0;
    if (c->pend == NULL)
        (void)emerg_send(c, 0, 0, TS_ST_SLOW_READER, msg, n);
    tsd_conn_begin_closing(c);
}

/*
 * What c's output really holds: the bytes not yet taken by the socket plus the allocations of
 * every batch queued or in flight (buffers at their capacity, arrays, structs). Small bytes are
 * counted twice (as bytes and in their buffer), which errs on the safe side.
 */
uint64_t tsd_conn_unwritten(tsd_conn *c)
{
    uint64_t q = tsd_stream_queue_size(c) + c->out_mem + c->fdq_bytes;
    if (c->pend != NULL)
        q += c->pend->bytes;
    return q;
}

/*
 * The soft limit: output may stay over output_soft for output_soft_seconds, then the reader
 * is cut off. Returns 1 when c was cut off.
 */
static int check_soft_limit(tsd_conn *c, uint64_t queued, uint64_t now)
{
    const tsd_config *cfg = &c->srv->cfg;
    if (cfg->output_soft == 0 || queued <= cfg->output_soft) {
        c->soft_since = 0;
        return 0;
    }
    if (c->soft_since == 0) {
        c->soft_since = now != 0 ? now : 1;
        return 0;
    }
    if (now - c->soft_since < (uint64_t)cfg->output_soft_seconds * 1000u)
        return 0;
    cut_off_slow_reader(c, queued, 1);
    return 1;
}

/* The output's part of the cron: the soft limit, then notifications held back. */
void tsd_out_cron(tsd_conn *c, uint64_t now)
{
    if (c->soft_since != 0)
        (void)check_soft_limit(c, tsd_conn_unwritten(c), now);
    if (c->held_head != NULL && !c->out_blocked)
        tsd_notify_release_held(c->srv, c);
}

int tsd_out_begin(tsd_conn *c, uint8_t op, uint32_t rid)
{
    c->mk.active = 0;
    c->mk.failed = 0;
    if (c->out_blocked || c->closing)
        return -1;
    /*
     * The limits are checked before a reply is queued, not against its size: one reply larger
     * than the limit (a big GET) is fine, a client that keeps asking without reading is not.
     */
    uint64_t limit = c->srv->cfg.max_output;
    uint64_t queued = tsd_conn_unwritten(c);
    if (c->pend != NULL && (c->pend->bytes >= TSD_WRITE_CHUNK || queued > limit)) {
        /* Measure what the socket did not take, not what this callback batched. */
        write_pending(c);
        queued = tsd_conn_unwritten(c);
    }
    if (queued > limit) {
        cut_off_slow_reader(c, queued, 0);
        return -1;
    }
    if (check_soft_limit(c, queued, uv_now(c->srv->loop)))
        return -1;
    out_mark(c, op, rid);
    return 0;
}

void tsd_reply(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const void *body, size_t len)
{
    if (tsd_out_begin(c, op, rid) != 0)
        return;
    c->mk.body = body != NULL ? body : "";
    c->mk.body_len = len;
    c->mk.body_status = status;
    if (tsd_out_hdr(c, op, rid, status, len) == 0 && len > 0) {
        uint8_t *p = tsd_out_bytes(c, len);
        if (p != NULL)
            memcpy(p, body, len);
    }
    c->mk.body = NULL;
}

void tsd_reply_msg(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *msg,
                   size_t n)
{
    uint8_t body[TS_MAX_ERRMSG];
    size_t len = 0;
    /* Messages are formatted into TS_MAX_ERRMSG bytes; a longer one would be cut here. */
    if (n > sizeof(body))
        n = sizeof(body);
    (void)ts__msg_error_encode(body, sizeof(body), msg, n, &len);
    tsd_reply(c, op, rid, status, body, len);
}

void tsd_reply_err(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
{
    char msg[TS_MAX_ERRMSG];
    va_list ap;
    va_start(ap, fmt);
    size_t n = ts__msg_error_vformat(msg, fmt, ap);
    va_end(ap);
    tsd_reply_msg(c, op, rid, status, msg, n);
}

void tsd_reply_state(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t version,
                     uint32_t n_items)
{
    uint8_t body[TS_BIN_STATE_SIZE];
    size_t len;
    (void)ts__msg_bin_state_encode(body, sizeof(body), version, n_items, &len);
    tsd_reply(c, op, rid, status, body, len);
}

void tsd_reply_oom(tsd_conn *c, uint8_t op, uint32_t rid, int rc, const char *what)
{
    if (rc == TS_EOOM) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "memory limit reached (--max-memory) %s",
                      what);
    } else {
        c->srv->stats.out_of_memory++;
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory %s", what);
    }
}

void tsd_reply_wait_error(tsd_conn *c, uint8_t op, uint32_t rid, int rc)
{
    if (rc == TS_ETOOMANY)
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "too many subscriptions and pending waits on this connection "
                      "(--max-watch)");
    else
        tsd_reply_oom(c, op, rid, rc, "waiting");
}

/* ---------------------------------------------------------------------------------------------
 * Flushing and closing
 */

static void on_shutdown(uv_shutdown_t *req, int status)
{
    tsd_conn *c = req->data;
    c->shut_done = 1;
    if (status < 0 || c->eof)
        tsd_conn_close(c);
}

/*
 * A connection on its way out whose output is all written: send FIN, then close once the peer
 * closes its side too (or the cron's deadline passes).
 */
void tsd_conn_maybe_finish(tsd_conn *c)
{
    if (c->closing || !c->close_after_flush || c->writes_in_flight > 0 || c->pend != NULL ||
        c->fdq_head != NULL)
        return;
    if (c->eof && (c->shut_done || c->close_deadline == 0)) {
        tsd_conn_close(c);
        return;
    }
    if (c->shut_started)
        return;
    c->shut_started = 1;
    c->shut_req.data = c;
    if (tsd_stream_shutdown(c, &c->shut_req, on_shutdown) != 0)
        tsd_conn_close(c);
}

static void on_write(uv_write_t *req, int status)
{
    tsd_wbatch *b = req->data;
    tsd_conn *c = b->conn;
    c->writes_in_flight--;
    if (status == 0)
        c->srv->stats.bytes_sent += b->bytes;
    batch_release(c, b);
    if (status < 0 && !c->closing) {
        tsd_log(TSD_LOG_DEBUG, "conn %llu: write failed: %s", (unsigned long long)c->id,
                uv_strerror(status));
        tsd_conn_close(c);
        return;
    }
    if (c->fdq_head != NULL && c->writes_in_flight == 0) {
        /* The frames before a descriptor frame are out: it may go now. */
        fdq_drain(c);
        if (c->closing)
            return;
    }
    if (c->held_head != NULL && !c->out_blocked) {
        /* The backlog shrank: held notifications may go now. */
        tsd_notify_release_held(c->srv, c);
        tsd_server_flush(c->srv);
        return;
    }
    tsd_conn_maybe_finish(c);
}

/*
 * Send b's bytes with its descriptors in one sendmsg (SCM_RIGHTS on the first byte), without
 * waiting: libuv's write queue is empty (the caller checked), so nothing can be overtaken. The
 * bytes sent (the rest goes through libuv as usual), UV_EAGAIN when the socket took nothing, or
 * a negative errno.
 */
static ssize_t send_with_fds(tsd_conn *c, tsd_wbatch *b, const uv_buf_t *bufs, size_t k)
{
    uv_os_fd_t sock;
    if (uv_fileno(&c->h.handle, &sock) != 0)
        return UV_EBADF;
    if (tsd_shm_fake_full())
        return UV_EAGAIN;
    struct iovec iov[TSD_SENDMSG_IOV];
    size_t n = k < TSD_SENDMSG_IOV ? k : TSD_SENDMSG_IOV;
    for (size_t i = 0; i < n; i++) {
        iov[i].iov_base = bufs[i].base;
        iov[i].iov_len = bufs[i].len;
    }
    union {
        struct cmsghdr align;
        char buf[CMSG_SPACE(sizeof(int) * TS_MAX_REF_ITEMS)];
    } ctl;
    memset(&ctl, 0, sizeof(ctl));
    struct msghdr msg = {0};
    msg.msg_iov = iov;
    msg.msg_iovlen = n;
    msg.msg_control = ctl.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * b->nfds);
    struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * b->nfds);
    memcpy(CMSG_DATA(cm), b->fds, sizeof(int) * b->nfds);
    ssize_t r;
    do
        r = sendmsg(sock, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (r < 0 && errno == EINTR);
    if (r < 0)
        return errno == EAGAIN || errno == EWOULDBLOCK ? UV_EAGAIN : -errno;
    return r;
}

/* Put b (its uv_bufs built) at the end of c's queue of batches waiting for a descriptor frame. */
static void fdq_push(tsd_conn *c, tsd_wbatch *b)
{
    b->fdq_next = NULL;
    if (c->fdq_tail != NULL)
        c->fdq_tail->fdq_next = b;
    else
        c->fdq_head = b;
    c->fdq_tail = b;
    c->fdq_bytes += b->bytes;
}

static tsd_wbatch *fdq_pop(tsd_conn *c)
{
    tsd_wbatch *b = c->fdq_head;
    c->fdq_head = b->fdq_next;
    if (c->fdq_head == NULL)
        c->fdq_tail = NULL;
    b->fdq_next = NULL;
    c->fdq_bytes -= b->bytes;
    return b;
}

/* The write failed: drop b and close c without grace (the peer is gone). */
static void batch_failed(tsd_conn *c, tsd_wbatch *b, int rc)
{
    tsd_log(TSD_LOG_DEBUG, "conn %llu: write: %s", (unsigned long long)c->id, uv_strerror(rc));
    batch_release(c, b);
    tsd_conn_begin_closing(c);
    c->close_deadline = 0; /* The peer is gone: no grace. */
}

/*
 * Write b, whose uv_bufs are built (b->nk of them), now that nothing waits before it in fdq.
 * 0 when it was written or handed to libuv; 1 when it must wait (it went to fdq: a batch behind
 * a write still in flight, or a descriptor batch whose socket was full); -1 on failure (the
 * connection is closing).
 */
static int batch_go(tsd_conn *c, tsd_wbatch *b, int at_head)
{
    uv_buf_t *bufs = b->bufs;
    size_t k = b->nk;
    int rc = 0;
    if (c->writes_in_flight == 0) {
        /*
         * Nothing queued: write now. Small replies usually go out whole, which spares libuv's
         * write request (a poll registration and a deferred callback) per reply.
         */
        ssize_t n;
        if (b->nfds > 0) {
            n = send_with_fds(c, b, bufs, k);
            if (n == UV_EAGAIN) {
                if (at_head) {
                    b->fdq_next = c->fdq_head;
                    c->fdq_head = b;
                    if (c->fdq_tail == NULL)
                        c->fdq_tail = b;
                    c->fdq_bytes += b->bytes;
                } else {
                    fdq_push(c, b);
                }
                tsd_log(TSD_LOG_DEBUG, "conn %llu: socket full for a descriptor frame, retrying",
                        (unsigned long long)c->id);
                tsd_server_fd_blocked(c->srv, c);
                return 1;
            }
            if (n >= 0) {
                tsd_shm_count_sent(b->nfds);
                batch_drop_fds(b, 0); /* the kernel holds its own references now */
            }
        } else {
            n = tsd_stream_try_write(c, bufs, (unsigned int)k);
        }
        if (n < 0 && n != UV_EAGAIN)
            rc = (int)n;
        for (size_t left = n > 0 ? (size_t)n : 0; left > 0 && k > 0;) {
            if (left >= bufs->len) {
                left -= bufs->len;
                bufs++;
                k--;
            } else {
                bufs->base += left;
                bufs->len -= left;
                left = 0;
            }
        }
        if (rc == 0 && k == 0) {
            c->srv->stats.bytes_sent += b->bytes;
            batch_release(c, b);
            return 0;
        }
    } else {
        /*
         * An earlier write is still with the socket: wait for it (on_write drains fdq). One
         * write at a time is handed to libuv, which cannot take back what it was handed, so
         * that a slow reader cut off (cut_off_slow_reader) is sent nothing beyond that write.
         */
        if (b->nfds > 0)
            tsd_log(TSD_LOG_DEBUG, "conn %llu: a descriptor frame waits for %u writes",
                    (unsigned long long)c->id, c->writes_in_flight);
        if (at_head) {
            b->fdq_next = c->fdq_head;
            c->fdq_head = b;
            if (c->fdq_tail == NULL)
                c->fdq_tail = b;
            c->fdq_bytes += b->bytes;
        } else {
            fdq_push(c, b);
        }
        return 1;
    }
    if (rc == 0) {
        b->req.data = b;
        rc = tsd_stream_write(c, &b->req, bufs, (unsigned int)k, on_write);
    }
    if (rc != 0) {
        batch_failed(c, b, rc);
        return -1;
    }
    c->writes_in_flight++;
    return 0;
}

/* Write the batches waiting in fdq, in order, as far as the socket and libuv's queue allow. */
static void fdq_drain(tsd_conn *c)
{
    while (c->fdq_head != NULL && !c->closing && c->writes_in_flight == 0) {
        tsd_wbatch *b = fdq_pop(c);
        if (batch_go(c, b, 1) != 0)
            return;
    }
}

void tsd_out_fd_retry(tsd_conn *c)
{
    if (c->closing)
        return;
    fdq_drain(c);
    tsd_conn_maybe_finish(c);
}

/*
 * Hand the pending batch to uv_write (which writes what the socket takes at once). Never closes
 * the connection itself, so it is safe while lists are being walked: on failure the connection
 * is marked to close at the next flush.
 */
static void write_pending(tsd_conn *c)
{
    tsd_wbatch *b = c->pend;
    if (b == NULL || c->closing)
        return;
    c->pend = NULL;
    /*
     * Build the uv_buf array, cutting long runs of small bytes to the write chunk too. Its
     * room was made as the batch grew (add_seg), so nothing is allocated here.
     */
    if (b->nbufs > b->bufs_cap) {
        batch_failed(c, b, UV_ENOMEM);
        return;
    }
    size_t k = 0;
    for (size_t i = 0; i < b->nsegs; i++) {
        const uint8_t *p = b->segs[i].ptr != NULL ? b->segs[i].ptr : b->small + b->segs[i].off;
        size_t left = b->segs[i].len;
        while (left > 0) {
            size_t n = left < TSD_WRITE_CHUNK ? left : TSD_WRITE_CHUNK;
            b->bufs[k++] = uv_buf_init((char *)p, (unsigned int)n);
            p += n;
            left -= n;
        }
    }
    b->nk = k;
    if (c->fdq_head != NULL) {
        /* A descriptor frame waits: everything after it waits too, in order. */
        fdq_push(c, b);
        return;
    }
    (void)batch_go(c, b, 0);
}

void tsd_out_cut(tsd_conn *c)
{
    if (c->pend != NULL && c->pend->bytes > 0)
        write_pending(c);
}

int tsd_out_fd(tsd_conn *c, int fd, int owned)
{
    tsd_wbatch *b = c->mk.failed ? NULL : pending(c);
    if (b == NULL || b->nfds >= TS_MAX_REF_ITEMS) {
        if (owned)
            (void)close(fd);
        out_abort(c);
        return -1;
    }
    b->fds[b->nfds] = fd;
    b->fd_owned[b->nfds] = (uint8_t)(owned != 0);
    b->nfds++;
    return 0;
}

void tsd_conn_flush(tsd_conn *c)
{
    if (c->closing)
        return;
    write_pending(c);
    tsd_conn_maybe_finish(c);
}

/* Drop the batch not yet handed to the socket (the connection is closing). */
void tsd_out_drop_pending(tsd_conn *c)
{
    if (c->pend != NULL) {
        batch_release(c, c->pend);
        c->pend = NULL;
    }
    while (c->fdq_head != NULL)
        batch_release(c, fdq_pop(c));
    tsd_server_fd_unblock(c->srv, c);
}

/* Free the batches kept for reuse (the connection is being freed). */
void tsd_out_free_cache(tsd_conn *c)
{
    while (c->batch_cache != NULL) {
        tsd_wbatch *b = c->batch_cache;
        c->batch_cache = b->next_free;
        batch_free(c, b);
    }
}

void tsd_conn_closing_frame(tsd_conn *c, uint16_t status, const char *msg)
{
    size_t n = strlen(msg);
    tsd_reply_msg(c, 0, 0, status, msg, n);
    /* A connection-level frame is not sent by out_abort: it goes through an emergency slot. */
    if (c->mk.failed)
        (void)emerg_send(c, 0, 0, status, msg, n);
    tsd_conn_begin_closing(c);
}

void tsd_conn_fail(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
{
    if (c->closing)
        return;
    char msg[TS_MAX_ERRMSG];
    va_list ap;
    va_start(ap, fmt);
    size_t n = ts__msg_error_vformat(msg, fmt, ap);
    va_end(ap);
    c->srv->stats.protocol_errors++;
    tsd_log(TSD_LOG_INFO, "conn %llu (%s): protocol error (%s): %s", (unsigned long long)c->id,
            c->peer, ts__status_name(status), msg);
    tsd_conn_drop_upload(c);
    tsd_reply_msg(c, op, rid, status, msg, n);
    tsd_conn_begin_closing(c);
}

/* ---------------------------------------------------------------------------------------------
 * Names in messages
 */

/* Length of the valid UTF-8 sequence at p (at most left bytes), or 0 when invalid. */
static size_t utf8_len(const uint8_t *p, size_t left)
{
    size_t n;
    uint32_t cp;
    if (p[0] < 0x80)
        return 1;
    if ((p[0] & 0xE0) == 0xC0) {
        n = 2;
        cp = p[0] & 0x1F;
    } else if ((p[0] & 0xF0) == 0xE0) {
        n = 3;
        cp = p[0] & 0x0F;
    } else if ((p[0] & 0xF8) == 0xF0) {
        n = 4;
        cp = p[0] & 0x07;
    } else {
        return 0;
    }
    if (n > left)
        return 0;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return n;
}

void tsd_name_printable(const uint8_t *name, size_t len, char *out, size_t cap)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    size_t i = 0;
    while (i < len) {
        size_t n = utf8_len(name + i, len - i);
        int c1 = n == 2 && name[i] == 0xC2 && name[i + 1] <= 0x9F; /* U+0080..U+009F */
        if (n == 1 && name[i] >= 0x20 && name[i] != 0x7F && name[i] != '\\') {
            if (o + 1 >= cap)
                break;
            out[o++] = (char)name[i];
        } else if (n == 1 && name[i] == '\\') {
            if (o + 2 >= cap)
                break;
            out[o++] = '\\';
            out[o++] = '\\';
        } else if (n > 1 && !c1) {
            if (o + n >= cap)
                break;
            memcpy(out + o, name + i, n);
            o += n;
        } else {
            n = n > 1 ? n : 1; /* a C1 control's two bytes, or one control or invalid byte */
            if (o + 4 * n >= cap)
                break;
            for (size_t k = 0; k < n; k++) {
                out[o++] = '\\';
                out[o++] = 'x';
                out[o++] = hex[name[i + k] >> 4];
                out[o++] = hex[name[i + k] & 15];
            }
        }
        i += n;
    }
    out[o] = '\0';
}
