/*
 * One client connection: the read state machine, the limits applied to every frame before any
 * allocation, and the output queue.
 *
 * Reading. Headers, names and control bodies land in a small per-connection buffer (ibuf). For a
 * PUT/APPEND, once the header and the name are in, the record length is checked against the
 * limits, the item buffer is allocated, the few record bytes already buffered are copied, and
 * libuv then reads the rest of the record straight into the item (the alloc callback hands out
 * the item's remaining region). One copy on the server: kernel to item.
 *
 * Writing. Replies are appended to a pending batch: small bytes in one growing buffer, item
 * buffers by reference (no copy, the batch holds a reference until the write callback). The
 * batch is handed to uv_write once the callback that produced it is done, so a pipeline of small
 * requests costs one write.
 */
#include "server.h"

#include "compress.h"
#include "record.h"

#include <stdio.h>
#include <unistd.h>

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void process_input(tsd_conn *c);
static void write_pending(tsd_conn *c);
static void maybe_finish(tsd_conn *c);
static void on_write(uv_write_t *req, int status);
static void drop_upload(tsd_conn *c);
static void start_discard(tsd_conn *c, uint64_t left);

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

/* Drop the batch's item references and keep it for reuse (or free it). */
static void batch_release(tsd_conn *c, tsd_wbatch *b)
{
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
static void begin_closing(tsd_conn *c)
{
    c->out_blocked = 1;
    if (!c->close_after_flush) {
        c->close_after_flush = 1;
        c->close_deadline = uv_now(c->srv->loop) + TSD_CLOSE_GRACE_MS;
    }
    c->rstate = TSD_RS_DEAD;
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
    maybe_finish(c);
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
    if (c->closing || (c->close_deadline == 0 && c->close_after_flush))
        return -1; /* the write failed: the peer is gone */
    if (len > TSD_EMERG_MSG)
        len = TSD_EMERG_MSG;
    ts__hdr h = {.magic = TS_MAGIC_REP,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .status = status,
                 .request_id = rid,
                 .body_len = len};
    ts__hdr_encode(&h, e->frame);
    if (len > 0)
        memcpy(e->frame + TS_HDR_SIZE, body, len);
    e->buf = uv_buf_init((char *)e->frame, (unsigned int)(TS_HDR_SIZE + len));
    e->req.data = c;
    if (uv_write(&e->req, &c->h.stream, &e->buf, 1, on_emerg_write) != 0)
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
        }
    }
    if (!c->mk.active || c->mk.op == TS_OP_NOTIFY || c->mk.op == 0)
        return; /* A notification is held by its caller; connection-level frames just go. */
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
    }
    c->mk.body = NULL;
    if (rc != 0) {
        tsd_log(TSD_LOG_WARN, "conn %llu: no room for an error frame either, closing",
                (unsigned long long)c->id);
        begin_closing(c);
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

int tsd_out_item(tsd_conn *c, tsd_item *it, int ref)
{
    if (ref)
        tsd_item_ref(it);
    if (c->mk.failed) {
        tsd_item_unref(it);
        return -1;
    }
    tsd_wbatch *b = pending(c);
    if (b == NULL ||
        grow((void **)&b->items, &b->items_cap, b->nitems + 1, sizeof(*b->items)) != 0) {
        if (b != NULL)
            batch_account(c, b);
        tsd_item_unref(it);
        out_abort(c);
        return -1;
    }
    b->items[b->nitems++] = it;
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
    size_t pad = ts__align_up(len, TS__ALIGN) - len;
    if (pad > 0) {
        uint8_t *p = tsd_out_bytes(c, pad);
        if (p == NULL)
            return -1;
        memset(p, 0, pad);
    }
    return 0;
}

int tsd_out_hdr(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t body_len)
{
    c->mk.status = status;
    uint8_t *p = tsd_out_bytes(c, TS_HDR_SIZE);
    if (p == NULL)
        return -1;
    ts__hdr h = {.magic = TS_MAGIC_REP,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .status = status,
                 .request_id = rid,
                 .body_len = body_len};
    ts__hdr_encode(&h, p);
    return 0;
}

/*
 * The connection reads slower than it asks: drop what is not yet written, tell it why, and
 * close it once that is written (or after the grace period).
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
    out_mark(c, 0, 0);
    size_t n = strlen(msg);
    if (tsd_out_hdr(c, 0, 0, TS_ST_SLOW_READER, n) == 0) {
        uint8_t *p = tsd_out_bytes(c, n);
        if (p != NULL)
            memcpy(p, msg, n);
    }
    c->mk.active = 0;
    if (c->pend == NULL)
        (void)emerg_send(c, 0, 0, TS_ST_SLOW_READER, msg, n);
    begin_closing(c);
}

/*
 * What c's output really holds: the bytes not yet taken by the socket plus the allocations of
 * every batch queued or in flight (buffers at their capacity, arrays, structs). Small bytes are
 * counted twice (as bytes and in their buffer), which errs on the safe side.
 */
uint64_t tsd_conn_unwritten(tsd_conn *c)
{
    uint64_t q = uv_stream_get_write_queue_size(&c->h.stream) + c->out_mem;
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

void tsd_conn_cron(tsd_conn *c, uint64_t now)
{
    tsd_server *srv = c->srv;
    if (c->closing)
        return;
    if (c->close_after_flush) {
        if (now >= c->close_deadline)
            tsd_conn_close(c);
        return;
    }
    if (!c->helloed && !c->uncounted && srv->cfg.hello_timeout_ms > 0 &&
        now - c->accepted_ms >= srv->cfg.hello_timeout_ms) {
        srv->stats.hello_timeouts++;
        tsd_conn_fail(c, 0, 0, TS_ST_TIMEOUT, "no HELLO within %u ms of connecting",
                      srv->cfg.hello_timeout_ms);
        return;
    }
    /*
     * The body deadline: a frame begun (header or body partly in) that makes no progress for
     * body_timeout_s is cut, and its upload reservation returned. Off-loop work is not input.
     */
    int mid_frame = c->rstate == TSD_RS_ITEM || c->rstate == TSD_RS_LZ4 ||
                    c->rstate == TSD_RS_DISCARD || (c->rstate == TSD_RS_HDR && c->ilen > c->ipos);
    if (c->helloed && mid_frame && srv->cfg.body_timeout_s > 0 &&
        now - c->last_input_ms >= (uint64_t)srv->cfg.body_timeout_s * 1000u) {
        srv->stats.body_timeouts++;
        tsd_conn_fail(c, 0, 0, TS_ST_TIMEOUT,
                      "no bytes of the frame being received for %u s (--body-timeout)",
                      srv->cfg.body_timeout_s);
        return;
    }
    if (c->soft_since != 0)
        (void)check_soft_limit(c, tsd_conn_unwritten(c), now);
    if (c->held_head != NULL && !c->out_blocked)
        tsd_notify_release_held(srv, c);
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

/* Format an error message into buf (TS_MAX_ERRMSG bytes); returns its length. */
static size_t format_msg(char *buf, const char *fmt, va_list ap)
{
    int n = vsnprintf(buf, TS_MAX_ERRMSG, fmt, ap);
    if (n < 0)
        return 0;
    return (size_t)n >= TS_MAX_ERRMSG ? TS_MAX_ERRMSG - 1 : (size_t)n;
}

void tsd_reply_err(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
{
    char msg[TS_MAX_ERRMSG];
    va_list ap;
    va_start(ap, fmt);
    size_t n = format_msg(msg, fmt, ap);
    va_end(ap);
    tsd_reply(c, op, rid, status, msg, n);
}

void tsd_reply_state(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, uint64_t version,
                     uint32_t n_items)
{
    uint8_t body[TS_BIN_STATE_SIZE];
    ts__put_u64le(body, version);
    ts__put_u32le(body + 8, n_items);
    ts__put_u32le(body + 12, 0);
    tsd_reply(c, op, rid, status, body, sizeof(body));
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
static void maybe_finish(tsd_conn *c)
{
    if (c->closing || !c->close_after_flush || c->writes_in_flight > 0 || c->pend != NULL)
        return;
    if (c->eof && (c->shut_done || c->close_deadline == 0)) {
        tsd_conn_close(c);
        return;
    }
    if (c->shut_started)
        return;
    c->shut_started = 1;
    c->shut_req.data = c;
    if (uv_shutdown(&c->shut_req, &c->h.stream, on_shutdown) != 0)
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
    if (c->held_head != NULL && !c->out_blocked) {
        /* The backlog shrank: held notifications may go now. */
        tsd_notify_release_held(c->srv, c);
        tsd_server_flush(c->srv);
        return;
    }
    maybe_finish(c);
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
    int rc = UV_ENOMEM;
    if (b->nbufs <= b->bufs_cap) {
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
        uv_buf_t *bufs = b->bufs;
        rc = 0;
        if (c->writes_in_flight == 0) {
            /*
             * Nothing queued: write now. Small replies usually go out whole, which spares
             * libuv's write request (a poll registration and a deferred callback) per reply.
             */
            int n = uv_try_write(&c->h.stream, bufs, (unsigned int)k);
            if (n < 0 && n != UV_EAGAIN)
                rc = n;
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
                return;
            }
        }
        if (rc == 0) {
            b->req.data = b;
            rc = uv_write(&b->req, &c->h.stream, bufs, (unsigned int)k, on_write);
        }
    }
    if (rc != 0) {
        tsd_log(TSD_LOG_DEBUG, "conn %llu: write: %s", (unsigned long long)c->id, uv_strerror(rc));
        batch_release(c, b);
        begin_closing(c);
        c->close_deadline = 0; /* The peer is gone: no grace. */
        return;
    }
    c->writes_in_flight++;
}

void tsd_conn_flush(tsd_conn *c)
{
    if (c->closing)
        return;
    write_pending(c);
    maybe_finish(c);
}

/*
 * Release whatever an interrupted upload holds: item, temporary buffer, reservation. While
 * off-loop work runs, the work owns the item and buffer; they are released when it returns.
 */
static void drop_upload(tsd_conn *c)
{
    if (c->job.busy)
        return;
    if (c->cur_item != NULL) {
        tsd_item_unref(c->cur_item);
        c->cur_item = NULL;
    }
    if (c->cur_tmp != NULL) {
        ts__free(c->cur_tmp);
        c->cur_tmp = NULL;
    }
    tsd_store_unreserve(&c->srv->store, c->cur_reserved);
    c->cur_reserved = 0;
}

/* Free a closed connection (its handle closed and no off-loop work outstanding). */
static void conn_free(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    while (c->batch_cache != NULL) {
        tsd_wbatch *b = c->batch_cache;
        c->batch_cache = b->next_free;
        batch_free(c, b);
    }
    if (c->ibuf != NULL)
        srv->store.conns -= TSD_IBUF_SIZE;
    srv->store.conns -= sizeof(*c);
    ts__free(c->ibuf);
    ts__free(c);
    tsd_server_conn_freed(srv);
}

static void on_close(uv_handle_t *h)
{
    tsd_conn *c = h->data;
    if (c->job.busy) {
        /* The thread pool still uses the item and buffer: free when the work returns. */
        c->job.free_after = 1;
        return;
    }
    conn_free(c);
}

void tsd_conn_close(tsd_conn *c)
{
    if (c->closing)
        return;
    tsd_server *srv = c->srv;
    c->closing = 1;
    c->out_blocked = 1;
    c->rstate = TSD_RS_DEAD;
    tsd_notify_conn_gone(srv, c);
    tsd_snapshot_conn_gone(srv, c);
    if (c->starved) {
        for (tsd_conn **p = &srv->starved; *p != NULL; p = &(*p)->starved_next) {
            if (*p == c) {
                *p = c->starved_next;
                break;
            }
        }
        c->starved = 0;
    }
    drop_upload(c);
    if (c->pend != NULL) {
        batch_release(c, c->pend);
        c->pend = NULL;
    }
    if (c->dirty) {
        for (tsd_conn **p = &srv->dirty; *p != NULL; p = &(*p)->dirty_next) {
            if (*p == c) {
                *p = c->dirty_next;
                break;
            }
        }
        c->dirty = 0;
    }
    if (c->unauth) {
        c->unauth = 0;
        srv->n_unauth--;
    }
    tsd_server_unlink_conn(srv, c);
    tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): closed", (unsigned long long)c->id, c->peer);
    /* Writes still queued get their callbacks (canceled) before on_close runs. */
    uv_close(&c->h.handle, on_close);
}

void tsd_conn_fail(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status, const char *fmt, ...)
{
    if (c->closing)
        return;
    char msg[TS_MAX_ERRMSG];
    va_list ap;
    va_start(ap, fmt);
    size_t n = format_msg(msg, fmt, ap);
    va_end(ap);
    c->srv->stats.protocol_errors++;
    tsd_log(TSD_LOG_INFO, "conn %llu (%s): protocol error (%s): %s", (unsigned long long)c->id,
            c->peer, ts__status_name(status), msg);
    drop_upload(c);
    tsd_reply(c, op, rid, status, msg, n);
    begin_closing(c);
}

/* ---------------------------------------------------------------------------------------------
 * Accepting
 */

tsd_conn *tsd_conn_alloc(void)
{
    return ts__calloc(1, sizeof(tsd_conn));
}

/* Fill c->peer with the peer's "ip:port" ("unix" for a unix socket, "?" when unknown). */
static void set_peer(tsd_conn *c)
{
    snprintf(c->peer, sizeof(c->peer), "%s", c->is_unix ? "unix" : "?");
    if (c->is_unix)
        return;
    struct sockaddr_storage ss;
    int len = (int)sizeof(ss);
    if (uv_tcp_getpeername(&c->h.tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    char ip[48];
    if (ss.ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
        if (uv_ip6_name(a, ip, sizeof(ip)) == 0)
            snprintf(c->peer, sizeof(c->peer), "[%s]:%u", ip, (unsigned)ntohs(a->sin6_port));
    } else if (ss.ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
        if (uv_ip4_name(a, ip, sizeof(ip)) == 0)
            snprintf(c->peer, sizeof(c->peer), "%s:%u", ip, (unsigned)ntohs(a->sin_port));
    }
}

/*
 * --max-unauth-clients is reached: close the oldest connection that has not completed HELLO,
 * so that a flood of idle connections cannot keep a real client from reaching HELLO (the newest
 * one is the likeliest to be about to say it). It stops counting at once.
 */
static void evict_oldest_unauth(tsd_server *srv)
{
    tsd_conn *old = NULL;
    for (tsd_conn *x = srv->conns; x != NULL; x = x->next)
        if (x->unauth && !x->close_after_flush)
            old = x; /* The list is newest first: the last one found is the oldest. */
    if (old == NULL)
        return;
    old->unauth = 0;
    srv->n_unauth--;
    old->uncounted = 1;
    srv->n_conns--;
    srv->stats.rejected_clients++;
    tsd_conn_fail(old, 0, 0, TS_ST_TOO_MANY_CLIENTS,
                  "too many clients before HELLO (limit %u): the oldest is closed",
                  srv->cfg.max_unauth);
    tsd_conn_flush(old);
}

/* Refuse c (just accepted) with TOO_MANY_CLIENTS and message msg, then close it. */
static void refuse(tsd_conn *c, const char *msg)
{
    tsd_server *srv = c->srv;
    /* It stays listed (shutdown closes it) but no longer counts as a client. */
    srv->n_conns--;
    c->uncounted = 1;
    srv->stats.rejected_clients++;
    tsd_log(TSD_LOG_WARN, "refusing a connection from %s: %s", c->peer, msg);
    tsd_reply(c, 0, 0, TS_ST_TOO_MANY_CLIENTS, msg, strlen(msg));
    begin_closing(c);
    /* Read (and drop) whatever it sends, so it sees our reply and FIN, not a reset. */
    if (uv_read_start(&c->h.stream, on_alloc, on_read) != 0)
        tsd_conn_close(c);
    else
        tsd_conn_flush(c);
}

void tsd_conn_accept(tsd_server *srv, tsd_conn *c, int fd, int is_unix)
{
    c->srv = srv;
    c->is_unix = is_unix;
    c->id = ++srv->next_conn_id;
    c->accepted_ms = uv_now(srv->loop);
    c->last_input_ms = c->accepted_ms;
    snprintf(c->peer, sizeof(c->peer), "%s", is_unix ? "unix" : "?");
    srv->store.conns += sizeof(*c);
    int rc = is_unix ? uv_pipe_init(srv->loop, &c->h.pipe, 0) : uv_tcp_init(srv->loop, &c->h.tcp);
    if (rc == 0)
        rc = is_unix ? uv_pipe_open(&c->h.pipe, fd) : uv_tcp_open(&c->h.tcp, fd);
    c->h.handle.data = c;
    srv->n_alive++;
    tsd_server_link_conn(srv, c);
    srv->stats.connections_total++;
    if (rc != 0) {
        /* The handle is initialized (it must be closed), but it does not own fd. */
        tsd_log(TSD_LOG_WARN, "accept: %s", uv_strerror(rc));
        close(fd);
        tsd_conn_close(c);
        return;
    }
    if (!is_unix) {
        /* Small replies must not wait for Nagle; big ones are written in large chunks anyway. */
        (void)uv_tcp_nodelay(&c->h.tcp, 1);
        (void)uv_tcp_keepalive(&c->h.tcp, 1, 60);
    } else {
        /*
         * A unix socket's default send buffer (about 200 kB) makes a 64 MiB reply take hundreds
         * of loop wake-ups; ask for one write chunk (the kernel caps it at wmem_max). TCP
         * autotunes its own, and setting it would switch that off.
         */
        int sz = (int)TSD_WRITE_CHUNK;
        (void)uv_send_buffer_size(&c->h.handle, &sz);
    }
    set_peer(c);
    /*
     * Authenticated clients (--max-clients) and connections still before HELLO
     * (--max-unauth-clients) are limited apart, so a flood of the latter never takes the
     * places of the former. c is counted in n_conns already.
     */
    char msg[96];
    if (srv->n_conns - 1 - srv->n_unauth >= srv->cfg.max_clients) {
        snprintf(msg, sizeof(msg), "too many clients (limit %u)", srv->cfg.max_clients);
        refuse(c, msg);
        return;
    }
    if (srv->n_unauth >= srv->cfg.max_unauth)
        evict_oldest_unauth(srv);
    c->unauth = 1;
    srv->n_unauth++;
    tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): accepted", (unsigned long long)c->id, c->peer);
    c->rstate = TSD_RS_HDR;
    rc = uv_read_start(&c->h.stream, on_alloc, on_read);
    if (rc != 0)
        tsd_conn_close(c);
}

void tsd_conn_resume_read(tsd_conn *c)
{
    if (c->closing)
        return;
    if (uv_read_start(&c->h.stream, on_alloc, on_read) != 0)
        tsd_conn_close(c);
}

/* ---------------------------------------------------------------------------------------------
 * Reading
 */

/*
 * Bytes that are read only to be dropped (refused uploads, connections on their way out). One
 * loop thread, so one buffer serves every connection.
 */
static uint8_t discard_buf[64 * 1024];

/* Bytes of the bulk body received so far. */
static uint64_t bulk_got(const tsd_conn *c)
{
    return c->bulk_total - c->bulk_left;
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    tsd_conn *c = h->data;
    (void)suggested;
    *buf = uv_buf_init(NULL, 0);
    switch (c->rstate) {
    case TSD_RS_ITEM:
    case TSD_RS_LZ4: {
        /*
         * Exactly the rest of the body, so the read never runs into the next frame, and never
         * past what is reserved (reserve_ahead keeps that above zero while bytes are due).
         */
        uint64_t n = c->bulk_left;
        uint64_t room = c->cur_reserved - bulk_got(c);
        if (n > room)
            n = room;
        if (n > UINT32_MAX)
            n = UINT32_MAX;
        *buf = uv_buf_init((char *)c->bulk_dst, (unsigned int)n);
        return;
    }
    case TSD_RS_DISCARD: {
        uint64_t n = c->bulk_left < sizeof(discard_buf) ? c->bulk_left : sizeof(discard_buf);
        *buf = uv_buf_init((char *)discard_buf, (unsigned int)n);
        return;
    }
    case TSD_RS_DEAD:
        *buf = uv_buf_init((char *)discard_buf, sizeof(discard_buf));
        return;
    case TSD_RS_HDR:
        if (c->ibuf == NULL) {
            c->ibuf = ts__malloc(TSD_IBUF_SIZE);
            if (c->ibuf == NULL)
                return; /* libuv reports UV_ENOBUFS to on_read */
            c->srv->store.conns += TSD_IBUF_SIZE;
        }
        if (c->ipos > 0) {
            memmove(c->ibuf, c->ibuf + c->ipos, c->ilen - c->ipos);
            c->ilen -= c->ipos;
            c->ipos = 0;
        }
        *buf = uv_buf_init((char *)c->ibuf + c->ilen, (unsigned int)(TSD_IBUF_SIZE - c->ilen));
        return;
    default:
        return;
    }
}

/* Take up to want bytes of buffered input into dst (may be NULL: discard). Returns the count. */
static size_t take_buffered(tsd_conn *c, uint8_t *dst, uint64_t want)
{
    size_t avail = c->ilen - c->ipos;
    size_t n = want < avail ? (size_t)want : avail;
    if (dst != NULL && n > 0)
        memcpy(dst, c->ibuf + c->ipos, n);
    c->ipos += n;
    return n;
}

/*
 * Write into msg (cap bytes) what fills the memory limit, for OUT_OF_MEMORY replies: the
 * counted total and its parts, so an operator sees whether items, bins, queued output, uploads
 * in progress or connections hold it.
 */
static void oom_message(const tsd_server *srv, uint64_t need, char *msg, size_t cap)
{
    const tsd_store *st = &srv->store;
    snprintf(msg, cap,
             "memory limit reached: %llu of %llu bytes used (items %llu, bin and item overhead "
             "%llu, output buffers %llu, uploads in progress %llu, connections %llu); %llu more "
             "needed",
             (unsigned long long)tsd_store_used(st), (unsigned long long)st->max_memory,
             (unsigned long long)st->held, (unsigned long long)st->overhead,
             (unsigned long long)st->output, (unsigned long long)st->reserved,
             (unsigned long long)st->conns, (unsigned long long)need);
}

/* The body of a refused upload has been skipped: answer OUT_OF_MEMORY, keep the connection. */
static void discard_done(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    c->rstate = TSD_RS_HDR;
    if (c->cur_refused) { /* not memory: snapshots are failing (start_upload) */
        c->cur_refused = 0;
        tsd_refuse_write(c, c->cur.opcode, c->cur.request_id);
        return;
    }
    srv->stats.oom_rejections++;
    srv->stats.ops[c->cur.opcode]++;
    if (c->cur_alloc_failed) {
        c->cur_alloc_failed = 0;
        tsd_reply_err(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the item buffer could not be allocated");
        return;
    }
    char msg[TS_MAX_ERRMSG];
    oom_message(srv, c->cur_raw_len, msg, sizeof(msg));
    tsd_reply(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
}

/* Refuse an upload for lack of memory: skip left body bytes, then reply (discard_done). */
static void start_discard(tsd_conn *c, uint64_t left)
{
    left -= take_buffered(c, NULL, left);
    if (left == 0) {
        discard_done(c);
        return;
    }
    c->bulk_left = left;
    c->rstate = TSD_RS_DISCARD;
}

/*
 * Keep the reservation of a bulk body ahead of its arrival: while bytes are due and less than
 * half a step is reserved beyond what arrived, reserve up to one more step. When the limit is
 * reached, the upload is dropped (its reservation returned) and the rest of its body skipped,
 * then answered OUT_OF_MEMORY. 0, or -1 when the upload was dropped.
 */
static int reserve_ahead(tsd_conn *c)
{
    if (c->bulk_left == 0)
        return 0;
    uint64_t ahead = c->cur_reserved - bulk_got(c);
    if (ahead >= c->bulk_left || ahead >= TSD_UPLOAD_STEP / 2)
        return 0;
    uint64_t more = c->bulk_total - c->cur_reserved;
    if (more > TSD_UPLOAD_STEP)
        more = TSD_UPLOAD_STEP;
    if (tsd_store_reserve(&c->srv->store, more) == 0) {
        c->cur_reserved += more;
        return 0;
    }
    uint64_t left = c->bulk_left;
    /* The amount named in the reply: what this upload would have needed in all. */
    c->cur_raw_len = c->cur_raw_len > c->bulk_total ? c->cur_raw_len : c->bulk_total;
    drop_upload(c);
    start_discard(c, left);
    return -1;
}

/* Hand a validated record to the store (the reservation now covers exactly the record). */
static void item_store(tsd_conn *c, tsd_item *it)
{
    size_t len = tsd_item_len(it);
    tsd_store_unreserve(&c->srv->store, c->cur_reserved - len);
    c->cur_reserved = 0;
    tsd_op_store(c, &c->cur, c->cur_name, c->cur_name_len, it);
}

static void fail_bad_record(tsd_conn *c, size_t len)
{
    tsd_conn_fail(c, c->cur.opcode, c->cur.request_id, TS_ST_BAD_RECORD,
                  "the %zu-byte record failed validation", len);
}

/* Results of off-loop work (job.rc). */
enum { JOB_OK = 0, JOB_BAD_LZ4, JOB_SHORT, JOB_BAD_RECORD };

/*
 * Thread pool: inflate the compressed body (when there is one), move the record to the start
 * of the buffer, and validate it. Touches only the job's item and buffer, which nothing on the
 * loop thread reads or frees while the job is busy.
 */
static void job_work(uv_work_t *req)
{
    tsd_conn *c = req->data;
    tsd_item *it = c->job.it;
    uint8_t *data = tsd_item_data(it);
    if (c->job.tmp != NULL) {
        size_t raw = c->job.raw;
        if (ts__lz4_decompress(c->job.tmp, c->job.tmp_len, data, raw) != 0) {
            c->job.rc = JOB_BAD_LZ4;
            return;
        }
        size_t nl = data[0];
        if (raw < 1 + nl + TS_REC_HDR_SIZE) {
            c->job.rc = JOB_SHORT;
            return;
        }
        /* cur_name is not touched on the loop thread while the job is busy. */
        tsd_item_set_len(it, raw - 1 - nl);
        memmove(c->cur_name, data + 1, nl);
        c->cur_name_len = (uint8_t)nl;
        memmove(data, data + 1 + nl, raw - 1 - nl);
    }
    size_t len = tsd_item_len(it);
    if (ts__record_validate(data, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0) {
        c->job.rc = JOB_BAD_RECORD;
        return;
    }
    c->job.rc = JOB_OK;
}

/* Loop thread: the work is back. Finish the request, then read on where the connection was. */
static void job_done(uv_work_t *req, int status)
{
    tsd_conn *c = req->data;
    tsd_server *srv = c->srv;
    tsd_item *it = c->job.it;
    uint8_t op = c->cur.opcode;
    uint32_t rid = c->cur.request_id;
    c->job.busy = 0;
    c->job.it = NULL;
    if (c->job.tmp != NULL) {
        ts__free(c->job.tmp);
        c->job.tmp = NULL;
        /* The compressed buffer's reservation goes; the item's stays. */
        tsd_store_unreserve(&srv->store, c->job.tmp_len);
        c->cur_reserved -= c->job.tmp_len;
    }
    if (c->closing || status != 0) {
        tsd_item_unref(it);
        tsd_store_unreserve(&srv->store, c->cur_reserved);
        c->cur_reserved = 0;
        if (c->job.free_after) {
            tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): freed once its off-loop work returned",
                    (unsigned long long)c->id, c->peer);
            conn_free(c);
        } else if (!c->closing)
            tsd_conn_close(c);
        tsd_server_flush(srv);
        return;
    }
    c->rstate = TSD_RS_HDR;
    switch (c->job.rc) {
    case JOB_OK:
        item_store(c, it);
        break;
    case JOB_BAD_LZ4:
        tsd_item_unref(it);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "malformed lz4 body");
        break;
    case JOB_SHORT:
        tsd_item_unref(it);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "%s body too short for its name and record",
                      ts__op_name(op));
        break;
    default:
        fail_bad_record(c, tsd_item_len(it));
        tsd_item_unref(it);
        break;
    }
    /* Frames that came in behind this one, then the socket again (also to drain a failed one). */
    if (c->rstate == TSD_RS_HDR)
        process_input(c);
    c->last_input_ms = uv_now(srv->loop);
    if (!c->closing && c->rstate != TSD_RS_WORK &&
        uv_read_start(&c->h.stream, on_alloc, on_read) != 0)
        tsd_conn_close(c);
    tsd_server_flush(srv);
}

/*
 * Move the rest of the request to the thread pool: reading pauses (so the connection's requests
 * keep their order) until job_done. tmp (with its length) is the compressed body, or NULL when
 * only validation is left. 0, or -1 when the work could not be queued (the caller does it
 * inline).
 */
static int job_start(tsd_conn *c, tsd_item *it, uint8_t *tmp, size_t tmp_len, size_t raw)
{
    c->job.it = it;
    c->job.tmp = tmp;
    c->job.tmp_len = tmp_len;
    c->job.raw = raw;
    c->job.free_after = 0;
    c->job.req.data = c;
    if (uv_queue_work(c->srv->loop, &c->job.req, job_work, job_done) != 0) {
        c->job.it = NULL;
        c->job.tmp = NULL;
        return -1;
    }
    c->job.busy = 1;
    c->rstate = TSD_RS_WORK;
    uv_read_stop(&c->h.stream);
    return 0;
}

/* A record has fully arrived in c->cur_item: validate it once and hand it to the store. */
static void item_done(tsd_conn *c)
{
    tsd_item *it = c->cur_item;
    c->cur_item = NULL;
    c->rstate = TSD_RS_HDR;
    size_t len = tsd_item_len(it);
    if (len >= TSD_OFFLOOP_MIN && job_start(c, it, NULL, 0, len) == 0)
        return;
    if (ts__record_validate(tsd_item_data(it), len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0) {
        tsd_item_unref(it);
        fail_bad_record(c, len);
        return;
    }
    item_store(c, it);
}

/* A compressed PUT/APPEND body has arrived in cur_tmp: decompress it into an item. */
static void lz4_done(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    uint8_t op = c->cur.opcode;
    uint32_t rid = c->cur.request_id;
    size_t raw = (size_t)c->cur_raw_len;
    c->rstate = TSD_RS_HDR;
    /* The inflated record needs its reservation too, while the compressed buffer still holds. */
    if (tsd_store_reserve(&srv->store, raw) != 0) {
        drop_upload(c);
        srv->stats.oom_rejections++;
        srv->stats.ops[op]++;
        char msg[TS_MAX_ERRMSG];
        oom_message(srv, raw, msg, sizeof(msg));
        tsd_reply(c, op, rid, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
        return;
    }
    c->cur_reserved += raw;
    tsd_item *it = tsd_item_new_sized(raw);
    if (it == NULL) {
        drop_upload(c);
        srv->stats.oom_rejections++;
        srv->stats.out_of_memory++;
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the buffer to decompress into could not be "
                      "allocated");
        return;
    }
    uint8_t *tmp = c->cur_tmp;
    size_t tmp_len = c->cur_tmp_len;
    c->cur_tmp = NULL;
    if (raw >= TSD_OFFLOOP_MIN && job_start(c, it, tmp, tmp_len, raw) == 0)
        return;
    uint8_t *data = tsd_item_data(it);
    int rc = ts__lz4_decompress(tmp, tmp_len, data, raw);
    ts__free(tmp);
    tsd_store_unreserve(&srv->store, tmp_len);
    c->cur_reserved -= tmp_len;
    if (rc != 0) {
        tsd_item_unref(it);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "malformed lz4 body");
        return;
    }
    size_t nl = data[0];
    if (raw < 1 + nl + TS_REC_HDR_SIZE) {
        tsd_item_unref(it);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "%s body too short for its name and record",
                      ts__op_name(op));
        return;
    }
    memcpy(c->cur_name, data + 1, nl);
    c->cur_name_len = (uint8_t)nl;
    /* Move the record to the start of the buffer, where tensor data is 64-byte aligned. */
    tsd_item_set_len(it, raw - 1 - nl);
    memmove(data, data + 1 + nl, raw - 1 - nl);
    c->cur_item = it;
    item_done(c);
}

/* Body bytes arrived straight into the bulk destination. */
static void bulk_received(tsd_conn *c, size_t n)
{
    c->bulk_dst += n;
    c->bulk_left -= n;
    if (c->bulk_left > 0) {
        (void)reserve_ahead(c);
        return;
    }
    if (c->rstate == TSD_RS_ITEM)
        item_done(c);
    else
        lz4_done(c);
}

/*
 * Check a compressed body's announced raw length against the limits of its opcode: the largest
 * input LZ4 handles, then the body limit (--max-frame for PUT/APPEND, the control body limit
 * for the others). 0, or -1 when the connection has been failed with TOO_LARGE.
 */
static int check_raw_len(tsd_conn *c, const ts__hdr *h, uint64_t raw)
{
    int upload = h->opcode == TS_OP_PUT || h->opcode == TS_OP_APPEND;
    uint64_t limit = upload ? c->srv->cfg.max_frame : TSD_MAX_CTRL_BODY;
    if (raw > TS_LZ4_MAX_RAW) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_TOO_LARGE,
                      "raw body of %llu bytes exceeds the largest lz4 input (%llu bytes)",
                      (unsigned long long)raw, (unsigned long long)TS_LZ4_MAX_RAW);
        return -1;
    }
    if (raw > limit) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_TOO_LARGE,
                      "%s raw body of %llu bytes exceeds the limit of %llu", ts__op_name(h->opcode),
                      (unsigned long long)raw, (unsigned long long)limit);
        return -1;
    }
    return 0;
}

/*
 * Check a header. Returns 0 and fills *h when the frame may proceed; otherwise the connection
 * has been failed (error reply queued, reading stopped) and -1 is returned.
 */
static int check_header(tsd_conn *c, const uint8_t *p, ts__hdr *h)
{
    const tsd_config *cfg = &c->srv->cfg;
    uint8_t op = p[2];
    uint32_t rid = ts__get_u32le(p + 8);
    if (p[0] != TS_MAGIC_REQ) {
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "bad magic 0x%02x (expected 0x%02x)", p[0],
                      TS_MAGIC_REQ);
        return -1;
    }
    if (p[1] != TS_PROTO_VERSION) {
        tsd_conn_fail(c, op, rid, TS_ST_UNSUPPORTED_VERSION,
                      "frame version %u is not supported (this server speaks %u)", p[1],
                      TS_PROTO_VERSION);
        return -1;
    }
    if ((p[3] & ~TS_FLAGS_KNOWN) != 0) {
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "unknown header flags 0x%02x", p[3]);
        return -1;
    }
    if (ts__hdr_decode(p, TS_MAGIC_REQ, h) != 0) {
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "reserved header fields must be 0");
        return -1;
    }
    if (h->status != 0) {
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "status must be 0 in a request");
        return -1;
    }
    if (!c->helloed) {
        if (h->body_len > TS_MAX_PREAUTH_BODY) {
            tsd_conn_fail(c, op, rid, TS_ST_TOO_LARGE, "body of %llu bytes before HELLO (limit %d)",
                          (unsigned long long)h->body_len, TS_MAX_PREAUTH_BODY);
            return -1;
        }
        if (op != TS_OP_HELLO) {
            tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "%s before HELLO: HELLO must come first",
                          ts__op_name(op));
            return -1;
        }
    }
    if ((h->flags & TS_FLAG_LZ4) && !c->lz4) {
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "lz4 body without negotiating it in HELLO");
        return -1;
    }
    if (h->body_len > cfg->max_frame) {
        tsd_conn_fail(c, op, rid, TS_ST_TOO_LARGE, "body of %llu bytes exceeds the limit of %llu",
                      (unsigned long long)h->body_len, (unsigned long long)cfg->max_frame);
        return -1;
    }
    if (op < TS_OP_HELLO || op > TS_OP_SAVE) {
        tsd_conn_fail(c, op, rid, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x", op);
        return -1;
    }
    if (op != TS_OP_PUT && op != TS_OP_APPEND && h->body_len > TSD_MAX_CTRL_BODY) {
        tsd_conn_fail(c, op, rid, TS_ST_TOO_LARGE, "%s body of %llu bytes (limit %d)",
                      ts__op_name(op), (unsigned long long)h->body_len, TSD_MAX_CTRL_BODY);
        return -1;
    }
    return 0;
}

/* A complete control frame (header at p, body after it); lz4 bodies are inflated first. */
static void control_frame(tsd_conn *c, const ts__hdr *h, const uint8_t *body)
{
    size_t len = (size_t)h->body_len;
    if (!(h->flags & TS_FLAG_LZ4)) {
        tsd_op_dispatch(c, h, body, len);
        return;
    }
    uint8_t raw[TSD_MAX_CTRL_BODY];
    uint64_t raw_len;
    /* process_input checked the raw length against the limit already. */
    if (ts__lz4_raw_len(body, len, &raw_len) != 0 || raw_len > sizeof(raw) ||
        ts__lz4_decompress(body, len, raw, (size_t)raw_len) != 0) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "malformed lz4 %s body",
                      ts__op_name(h->opcode));
        return;
    }
    tsd_op_dispatch(c, h, raw, (size_t)raw_len);
}

/*
 * Start a PUT/APPEND once its header and name (or, compressed, its raw length) are buffered.
 * Returns 1 when more input is needed before anything can be decided, else 0.
 */
static int start_upload(tsd_conn *c, const ts__hdr *h)
{
    tsd_server *srv = c->srv;
    const uint8_t *body = c->ibuf + c->ipos + TS_HDR_SIZE;
    size_t avail = c->ilen - c->ipos - TS_HDR_SIZE;
    uint64_t blen = h->body_len;

    /* Snapshots are failing (--stop-writes-on-save-error): nothing reserved, body skipped. */
    if (tsd_writes_refused(srv)) {
        c->cur = *h;
        c->ipos += TS_HDR_SIZE;
        c->cur_refused = 1;
        start_discard(c, blen);
        return 0;
    }

    if (h->flags & TS_FLAG_LZ4) {
        if (blen < TS_LZ4_PREFIX + 1) {
            tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST,
                          "compressed body too short");
            return 0;
        }
        if (avail < TS_LZ4_PREFIX)
            return 1;
        uint64_t raw = ts__get_u64le(body);
        if (check_raw_len(c, h, raw) != 0)
            return 0;
        if (raw < 1 + TS_REC_HDR_SIZE) {
            tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST,
                          "%s body too short for a record", ts__op_name(h->opcode));
            return 0;
        }
        /*
         * Only raw is reserved, yet the compressed buffer is blen bytes: a body longer than any
         * block of raw bytes can be is malformed, and refusing it now keeps that buffer within
         * the reservation's order (and raw within what LZ4 handles).
         */
        if (blen > ts__lz4_bound((size_t)raw)) {
            tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST,
                          "compressed body of %llu bytes is longer than any lz4 block of a "
                          "%llu-byte body",
                          (unsigned long long)blen, (unsigned long long)raw);
            return 0;
        }
        c->cur = *h;
        c->ipos += TS_HDR_SIZE;
        /*
         * The compressed buffer is reserved as its bytes arrive (reserve_ahead), the inflated
         * record once the body is complete (lz4_done).
         */
        c->cur_raw_len = raw;
        c->bulk_total = blen;
        c->cur_reserved = 0;
        uint64_t first = blen < TSD_UPLOAD_STEP ? blen : TSD_UPLOAD_STEP;
        if (tsd_store_reserve(&srv->store, first) != 0) {
            start_discard(c, blen);
            return 0;
        }
        c->cur_reserved = first;
        c->cur_tmp = ts__malloc((size_t)blen);
        if (c->cur_tmp == NULL) {
            drop_upload(c);
            srv->stats.out_of_memory++;
            c->cur_alloc_failed = 1;
            start_discard(c, blen);
            return 0;
        }
        c->cur_tmp_len = (size_t)blen;
        size_t got = take_buffered(c, c->cur_tmp, blen);
        c->bulk_dst = c->cur_tmp + got;
        c->bulk_left = blen - got;
        c->rstate = TSD_RS_LZ4;
        if (c->bulk_left == 0)
            lz4_done(c);
        else
            (void)reserve_ahead(c);
        return 0;
    }

    if (blen < 1) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "%s body without a name",
                      ts__op_name(h->opcode));
        return 0;
    }
    if (avail < 1)
        return 1;
    size_t nl = body[0];
    if (blen < 1 + (uint64_t)nl) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST,
                      "%s body shorter than its name", ts__op_name(h->opcode));
        return 0;
    }
    if (avail < 1 + nl)
        return 1;
    uint64_t rlen = blen - 1 - nl;
    if (rlen < TS_REC_HDR_SIZE) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_RECORD,
                      "record of %llu bytes is shorter than a record header",
                      (unsigned long long)rlen);
        return 0;
    }
    c->cur = *h;
    memcpy(c->cur_name, body + 1, nl);
    c->cur_name_len = (uint8_t)nl;
    c->ipos += TS_HDR_SIZE + 1 + nl;
    /*
     * The record goes straight into its item buffer, allocated whole now (untouched pages cost
     * nothing), while the reservation follows the bytes as they arrive (reserve_ahead): a client
     * that declares a huge body and stalls holds one step, not the whole length.
     */
    c->cur_raw_len = rlen;
    c->bulk_total = rlen;
    c->cur_reserved = 0;
    uint64_t first = rlen < TSD_UPLOAD_STEP ? rlen : TSD_UPLOAD_STEP;
    if (tsd_store_reserve(&srv->store, first) != 0) {
        start_discard(c, rlen);
        return 0;
    }
    c->cur_reserved = first;
    c->cur_item = tsd_item_new((size_t)rlen);
    if (c->cur_item == NULL) {
        drop_upload(c);
        srv->stats.out_of_memory++;
        c->cur_alloc_failed = 1;
        start_discard(c, rlen);
        return 0;
    }
    uint8_t *dst = tsd_item_data(c->cur_item);
    size_t got = take_buffered(c, dst, rlen);
    c->bulk_dst = dst + got;
    c->bulk_left = rlen - got;
    c->rstate = TSD_RS_ITEM;
    if (c->bulk_left == 0)
        item_done(c);
    else
        (void)reserve_ahead(c);
    return 0;
}

/* Handle every complete frame in ibuf; stop at a partial one or when the state leaves HDR. */
static void process_input(tsd_conn *c)
{
    while (c->rstate == TSD_RS_HDR) {
        size_t avail = c->ilen - c->ipos;
        if (avail < TS_HDR_SIZE)
            break;
        ts__hdr h;
        if (check_header(c, c->ibuf + c->ipos, &h) != 0)
            break;
        if (h.opcode == TS_OP_PUT || h.opcode == TS_OP_APPEND) {
            if (start_upload(c, &h) != 0)
                break;
            continue;
        }
        const uint8_t *body = c->ibuf + c->ipos + TS_HDR_SIZE;
        if (h.flags & TS_FLAG_LZ4) {
            /* The raw length is checked as soon as it is in, before the rest is waited for. */
            if (h.body_len < TS_LZ4_PREFIX + 1) {
                tsd_conn_fail(c, h.opcode, h.request_id, TS_ST_BAD_REQUEST,
                              "compressed body too short");
                break;
            }
            if (avail - TS_HDR_SIZE < TS_LZ4_PREFIX)
                break;
            if (check_raw_len(c, &h, ts__get_u64le(body)) != 0)
                break;
        }
        if (avail - TS_HDR_SIZE < h.body_len)
            break;
        c->ipos += TS_HDR_SIZE + (size_t)h.body_len;
        if (h.opcode == TS_OP_HELLO && c->unauth &&
            c->srv->n_conns - c->srv->n_unauth >= c->srv->cfg.max_clients) {
            /* Every place for an authenticated client is taken. */
            c->srv->stats.rejected_clients++;
            tsd_conn_fail(c, h.opcode, h.request_id, TS_ST_TOO_MANY_CLIENTS,
                          "too many clients (limit %u)", c->srv->cfg.max_clients);
            break;
        }
        control_frame(c, &h, body);
        if (c->unauth && c->helloed) {
            c->unauth = 0;
            c->srv->n_unauth--;
            tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): HELLO accepted", (unsigned long long)c->id,
                    c->peer);
        }
    }
    if (c->ibuf != NULL && c->ipos == c->ilen)
        c->ipos = c->ilen = 0;
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    tsd_conn *c = s->data;
    tsd_server *srv = c->srv;
    (void)buf;
    if (c->closing)
        return;
    if (nread == UV_ENOBUFS) {
        /* No input buffer could be allocated: pause reading and try again shortly. */
        uv_read_stop(s);
        srv->stats.out_of_memory++;
        tsd_server_starve(srv, c);
        return;
    }
    if (nread < 0) {
        if (nread != UV_EOF) {
            tsd_log(TSD_LOG_DEBUG, "conn %llu: read: %s", (unsigned long long)c->id,
                    uv_strerror((int)nread));
            tsd_conn_close(c);
        } else if (c->close_after_flush || c->writes_in_flight > 0 || c->pend != NULL) {
            /* The peer is done sending; a half-closed client still gets its replies. */
            uv_read_stop(s);
            c->eof = 1;
            begin_closing(c);
            maybe_finish(c);
        } else {
            tsd_conn_close(c);
        }
        tsd_server_flush(srv);
        return;
    }
    if (nread == 0)
        return;
    srv->stats.bytes_received += (uint64_t)nread;
    c->last_input_ms = uv_now(srv->loop);
    switch (c->rstate) {
    case TSD_RS_HDR:
        c->ilen += (size_t)nread;
        break;
    case TSD_RS_ITEM:
    case TSD_RS_LZ4:
        bulk_received(c, (size_t)nread);
        break;
    case TSD_RS_DISCARD:
        c->bulk_left -= (uint64_t)nread;
        if (c->bulk_left == 0)
            discard_done(c);
        break;
    default:
        return; /* TSD_RS_DEAD: dropped (TSD_RS_WORK does not read). */
    }
    process_input(c);
    tsd_server_flush(srv);
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
    size_t o = 0;
    size_t i = 0;
    while (i < len && o + 5 < cap) {
        size_t n = utf8_len(name + i, len - i);
        if (n == 1 && name[i] >= 0x20 && name[i] != 0x7F) {
            out[o++] = (char)name[i];
        } else if (n > 1) {
            memcpy(out + o, name + i, n);
            o += n;
        } else {
            out[o++] = '?';
            n = 1;
        }
        i += n;
    }
    out[o] = '\0';
}
