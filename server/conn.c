/*
 * One client connection: accepting it, the read state machine, the limits applied to every frame
 * before any allocation (src/msg.c's ts__msg_request_check), uploads, and closing. Its output
 * queue is output.c.
 *
 * Reading. Headers, names and control bodies land in a small per-connection buffer (ibuf). For a
 * PUT/APPEND, once the header and the name are in, the record length is checked against the
 * limits, the item buffer is allocated, the few record bytes already buffered are copied, and
 * libuv then reads the rest of the record straight into the item (the alloc callback hands out
 * the item's remaining region). One copy on the server: kernel to item. That is why the PUT and
 * APPEND head is parsed here (with ts__msg_put_head_decode) while every other request body is
 * parsed whole in ops.c.
 */
#include "server.h"
#include "coord.h"
#include "ps.h"
#include "service.h"
#include "stream.h"
#include "table.h"

#include "compress.h"
#include "msg.h"
#include "record.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf);
static void process_input(tsd_conn *c);
static void start_discard(tsd_conn *c, uint64_t left);

/*
 * Start reading again (after a pause, or to drain a connection on its way out). Reading that is
 * on already is fine, and so is a peer that has closed its side (nothing is left to read). 0, or
 * a libuv code.
 */
static int read_on(tsd_conn *c)
{
    if (c->eof)
        return 0;
    int rc = tsd_read_start(c, on_alloc, on_read);
    return rc == UV_EALREADY ? 0 : rc;
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
        if (tsd_conn_tls_handshaking(c)) {
            /*
             * Without a finished handshake the TIMEOUT frame cannot be sent (only TLS records
             * go on this connection): close at the deadline, instead of after the grace that
             * tsd_conn_fail gives a reply to be written.
             */
            srv->stats.protocol_errors++;
            tsd_log(TSD_LOG_INFO,
                    "conn %llu (%s): protocol error: no TLS handshake within %u ms of connecting",
                    (unsigned long long)c->id, c->peer, srv->cfg.hello_timeout_ms);
            tsd_conn_close(c);
            return;
        }
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
    tsd_out_cron(c, now);
}
/*
 * Release whatever an interrupted upload holds: item, temporary buffer, reservation. While
 * off-loop work runs, the work owns the item and buffer; they are released when it returns.
 */
void tsd_conn_drop_upload(tsd_conn *c)
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
    tsd_out_free_cache(c);
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
    if (c->job.busy || c->held) {
        /*
         * The thread pool still uses the item and buffer, or the held request's work is still
         * out: free when it returns.
         */
        c->free_after = 1;
        return;
    }
    conn_free(c);
}

/* ---------------------------------------------------------------------------------------------
 * Received descriptors
 */

static void scratch_closed(uv_handle_t *h)
{
    ts__free(h);
}

/*
 * Move the descriptors libuv received with the last read into c's queue (oldest first). A
 * connection without FDS granted keeps none: they are closed at once. Past
 * TSD_MAX_PENDING_FDS unclaimed ones the connection fails (BAD_REQUEST). 0, or -1 when c failed.
 */
static int take_fds(tsd_conn *c)
{
    if (!c->is_unix)
        return 0;
    int failed = 0;
    while (uv_pipe_pending_count(&c->h.pipe) > 0) {
        /*
         * libuv hands a received descriptor over only through uv_accept into a handle; a
         * scratch pipe takes it, and a duplicate outlives the scratch (closing it closes the
         * original).
         */
        uv_pipe_t *scratch = ts__malloc(sizeof(*scratch));
        int fd = -1;
        if (scratch != NULL && uv_pipe_init(c->srv->loop, scratch, 0) == 0) {
            uv_os_fd_t got;
            if (uv_accept(&c->h.stream, (uv_stream_t *)scratch) == 0 &&
                uv_fileno((uv_handle_t *)scratch, &got) == 0)
                fd = fcntl(got, F_DUPFD_CLOEXEC, 3);
            uv_close((uv_handle_t *)scratch, scratch_closed);
        } else {
            ts__free(scratch);
            /* No memory for the scratch handle: the descriptor stays queued in libuv. */
            failed = 1;
            break;
        }
        if (fd < 0)
            continue;
        if (!c->fds_ok || c->n_fds_in >= TSD_MAX_PENDING_FDS || c->closing ||
            c->rstate == TSD_RS_DEAD) {
            (void)close(fd);
            if (c->fds_ok && c->n_fds_in >= TSD_MAX_PENDING_FDS && !c->out_blocked)
                failed = 2;
            continue;
        }
        c->fds_in[c->n_fds_in++] = fd;
        tsd_shm_count_pending(1, 1);
    }
    if (failed == 2) {
        tsd_conn_fail(c, 0, 0, TS_ST_BAD_REQUEST,
                      "more than %u descriptors received and not claimed by a frame",
                      TSD_MAX_PENDING_FDS);
        return -1;
    }
    if (failed == 1) {
        c->srv->stats.out_of_memory++;
        tsd_conn_fail(c, 0, 0, TS_ST_INTERNAL, "out of memory receiving descriptors");
        return -1;
    }
    return 0;
}

/* Take the oldest received descriptor for the frame being handled; -1 when none is queued. */
static int fds_claim(tsd_conn *c)
{
    if (c->n_fds_in == 0)
        return -1;
    int fd = c->fds_in[0];
    c->n_fds_in--;
    memmove(c->fds_in, c->fds_in + 1, c->n_fds_in * sizeof(c->fds_in[0]));
    tsd_shm_count_pending(-1, 0);
    return fd;
}

/* Close every descriptor c still holds (received ones not claimed, one claimed and unused). */
void tsd_conn_fds_close(tsd_conn *c)
{
    while (c->n_fds_in > 0)
        (void)close(fds_claim(c));
    if (c->claimed_fd >= 0) {
        (void)close(c->claimed_fd);
        c->claimed_fd = -1;
    }
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
    tsd_conn_drop_upload(c);
    tsd_out_drop_pending(c);
    tsd_conn_fds_close(c);
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
    tsd_stream_close(c, on_close);
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
    tsd_reply_msg(c, 0, 0, TS_ST_TOO_MANY_CLIENTS, msg, strlen(msg));
    tsd_conn_begin_closing(c);
    /* Read (and drop) whatever it sends, so it sees our reply and FIN, not a reset. */
    if (tsd_read_start(c, on_alloc, on_read) != 0)
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
    c->claimed_fd = -1;
    /*
     * Unix sockets are libuv ipc pipes, so that descriptors a client sends (SCM_RIGHTS, HELLO
     * FDS) are received and queued by libuv instead of being lost (take_fds collects them).
     */
    int rc = is_unix ? uv_pipe_init(srv->loop, &c->h.pipe, 1) : uv_tcp_init(srv->loop, &c->h.tcp);
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
    if (!is_unix && srv->cfg.tls_ctx != NULL && tsd_conn_tls_start(c) != 0) {
        tsd_log(TSD_LOG_WARN, "accept: no memory for a TLS session with %s", c->peer);
        tsd_conn_close(c);
        return;
    }
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
    rc = tsd_read_start(c, on_alloc, on_read);
    if (rc != 0)
        tsd_conn_close(c);
}

void tsd_conn_resume_read(tsd_conn *c)
{
    if (c->closing)
        return;
    if (read_on(c) != 0)
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
 * counted total and every part of it (they add up to the total, see tsd_store_used), so an
 * operator sees whether items, items kept alive by replies or snapshots, bins, queued output,
 * uploads in progress or connections hold it.
 */
static void oom_message(const tsd_server *srv, uint64_t need, char *msg, size_t cap)
{
    const tsd_store *st = &srv->store;
    snprintf(msg, cap,
             "memory limit reached: %llu of %llu bytes used (items %llu, orphaned items %llu, bin "
             "and item overhead %llu, output buffers %llu, uploads in progress %llu, connections "
             "%llu); %llu more needed",
             (unsigned long long)tsd_store_used(st), (unsigned long long)st->max_memory,
             (unsigned long long)st->held, (unsigned long long)st->orphaned_bytes,
             (unsigned long long)st->overhead, (unsigned long long)st->output,
             (unsigned long long)st->reserved, (unsigned long long)st->conns,
             (unsigned long long)need);
}

/*
 * An upload's reply is queued: with timing on, count its latency from the read that completed
 * its header (the request's time in tensord: receiving the body, storing, replying).
 */
static void upload_timed(tsd_conn *c)
{
    if (c->srv->stats.timing)
        tsd_latency_observe(&c->srv->stats, c->cur.opcode, ts__now_ns() - c->up_t0);
}

/* The body of a refused upload has been skipped: answer OUT_OF_MEMORY, keep the connection. */
static void discard_reply(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    c->rstate = TSD_RS_HDR;
    /* Counted as GET and DELETE are: a refused request whose body has arrived. */
    srv->stats.ops[c->cur.opcode]++;
    if (c->cur_refused) { /* not memory: snapshots are failing (start_upload) */
        c->cur_refused = 0;
        tsd_refuse_write(c, c->cur.opcode, c->cur.request_id);
        return;
    }
    if (c->cur_wrong_shard) { /* another shard's name (start_upload) */
        c->cur_wrong_shard = 0;
        (void)tsd_shard_refuse(c, c->cur.opcode, c->cur.request_id, c->cur_name, c->cur_name_len);
        return;
    }
    if (c->cur_stream_status != 0) { /* a STREAM_APPEND or TABLE_INSERT refused (start_upload) */
        uint16_t status = c->cur_stream_status;
        c->cur_stream_status = 0;
        if (c->cur.opcode == TS_OP_TABLE_INSERT)
            tsd_table_refuse_insert(c, &c->cur, c->cur_name, c->cur_name_len, status);
        else
            tsd_stream_refuse_append(c, &c->cur, c->cur_name, c->cur_name_len, status);
        return;
    }
    srv->stats.oom_rejections++;
    if (c->cur_disk_rc != 0) {
        char dmsg[TS_MAX_ERRMSG];
        tsd_datadir_refusal(srv, c->cur_disk_rc, (size_t)c->cur_raw_len, dmsg, sizeof(dmsg));
        c->cur_disk_rc = 0;
        tsd_reply_msg(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY, dmsg, strlen(dmsg));
        return;
    }
    if (c->cur_alloc_failed) {
        c->cur_alloc_failed = 0;
        tsd_reply_err(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the item buffer could not be allocated");
        return;
    }
    if (c->cur_capped) {
        c->cur_capped = 0;
        char cmsg[TS_MAX_ERRMSG];
        snprintf(cmsg, sizeof(cmsg),
                 "memory limit for uploads in progress reached: %llu bytes reserved by unfinished "
                 "uploads, at most 1/%u of %llu; retry when they finish",
                 (unsigned long long)srv->store.reserved, TSD_UPLOAD_SHARE_DIV,
                 (unsigned long long)srv->store.max_memory);
        tsd_reply_msg(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY, cmsg, strlen(cmsg));
        return;
    }
    char msg[TS_MAX_ERRMSG];
    oom_message(srv, c->cur_raw_len, msg, sizeof(msg));
    tsd_reply_msg(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
}

static void discard_done(tsd_conn *c)
{
    discard_reply(c);
    upload_timed(c);
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
    if (ahead >= c->bulk_left || ahead >= c->cur_step / 2)
        return 0;
    uint64_t more = c->bulk_total - c->cur_reserved;
    if (more > c->cur_step)
        more = c->cur_step;
    if (tsd_store_reserve(&c->srv->store, more) == 0) {
        c->cur_reserved += more;
        /* The steps grow only as bytes arrive: a trickling body stays at its first small step. */
        if (c->cur_step < TSD_UPLOAD_STEP)
            c->cur_step *= 2;
        return 0;
    }
    uint64_t left = c->bulk_left;
    /* The amount named in the reply: what this upload would have needed in all. */
    c->cur_raw_len = c->cur_raw_len > c->bulk_total ? c->cur_raw_len : c->bulk_total;
    tsd_conn_drop_upload(c);
    start_discard(c, left);
    return -1;
}

/*
 * Hand a validated record to its handler. The reservation covers the record's length (which the
 * handler consumes: linked into the store, taken by a stream or table, or returned) and, apart,
 * the item's overhead (item_store). 1 when the handler ran, 0 when the upload was refused first.
 */
static int item_dispatch(tsd_conn *c, tsd_item *it, size_t len)
{
    /* A compressed upload's name is known once inflated: another shard's is refused now. */
    if (tsd_shard_refuse(c, c->cur.opcode, c->cur.request_id, c->cur_name, c->cur_name_len)) {
        c->srv->stats.ops[c->cur.opcode]++;
        tsd_store_unreserve(&c->srv->store, len);
        tsd_item_unref(it);
        return 0;
    }
    if (c->cur.opcode == TS_OP_TABLE_INSERT) {
        tsd_table_insert(c, &c->cur, c->cur_name, c->cur_name_len, c->cur_fixed, c->cur_fixed_len,
                         it); /* table.c */
    } else if (c->cur.opcode == TS_OP_SVC_CALL || c->cur.opcode == TS_OP_SVC_REPLY) {
        /* Services have names of their own, apart from bins. */
        tsd_svc_upload(c, &c->cur, c->cur_name, c->cur_name_len, c->cur_fixed, it); /* service.c */
    } else if (c->cur.opcode == TS_OP_EMB_PULL || c->cur.opcode == TS_OP_EMB_PUSH) {
        /* So have embedding tables (docs/PS.md): a replay table's name is no concern of theirs. */
        tsd_ps_upload(c, &c->cur, c->cur_name, c->cur_name_len, c->cur_fixed, c->cur_fixed_len,
                      it); /* ps.c */
    } else if (c->cur.opcode != TS_OP_PUT && c->cur.opcode != TS_OP_APPEND &&
               tsd_table_refuse_name(c, c->cur.opcode, c->cur.request_id, c->cur_name,
                                     c->cur_name_len)) {
        c->srv->stats.ops[c->cur.opcode]++; /* a stream or rows upload naming a replay table */
        tsd_store_unreserve(&c->srv->store, len);
        tsd_item_unref(it);
    } else if (c->cur.opcode == TS_OP_STREAM_APPEND) {
        tsd_stream_append(c, &c->cur, c->cur_name, c->cur_name_len, it); /* stream.c */
    } else if ((c->cur.opcode == TS_OP_GATHER_ROWS || c->cur.opcode == TS_OP_WRITE_ROWS) &&
               tsd_stream_refuse_name(c, c->cur.opcode, c->cur.request_id, c->cur_name,
                                      c->cur_name_len)) {
        c->srv->stats.ops[c->cur.opcode]++;
        tsd_store_unreserve(&c->srv->store, len);
        tsd_item_unref(it);
    } else if (c->cur.opcode == TS_OP_GATHER_ROWS || c->cur.opcode == TS_OP_WRITE_ROWS)
        tsd_rows_upload(c, &c->cur, c->cur_name, c->cur_name_len, it); /* rows.c */
    else if (c->cur.opcode == TS_OP_PUT_IF)
        tsd_coord_put_if(c, &c->cur, c->cur_name, c->cur_name_len, c->cur_fixed, it); /* coord.c */
    else if (c->cur.opcode == TS_OP_PS_PUSH)
        tsd_ps_upload(c, &c->cur, c->cur_name, c->cur_name_len, c->cur_fixed, c->cur_fixed_len,
                      it); /* ps.c */
    else
        tsd_op_store(c, &c->cur, c->cur_name, c->cur_name_len, it);
    return 1;
}

/*
 * Hand a validated record to the store. What the item takes once stored, its record bytes plus
 * its overhead (the rounding of its buffer and its header: tsd_item_overhead), is reserved
 * first, so that --max-memory bounds the allocation and not only the bytes received: past the
 * limit the upload is answered OUT_OF_MEMORY and nothing is stored. The overhead's part stays
 * reserved while the handler runs (which counts it as the store's overhead when it keeps the
 * item), so nothing the handler charges meanwhile can take its place.
 */
static void item_store(tsd_conn *c, tsd_item *it)
{
    tsd_server *srv = c->srv;
    size_t len = tsd_item_len(it);
    uint64_t extra = tsd_item_overhead(it);
    uint64_t cost = (uint64_t)len + extra;
    if (cost > c->cur_reserved && tsd_store_reserve(&srv->store, cost - c->cur_reserved) != 0) {
        tsd_store_unreserve(&srv->store, c->cur_reserved);
        c->cur_reserved = 0;
        tsd_item_unref(it);
        srv->stats.ops[c->cur.opcode]++;
        srv->stats.oom_rejections++;
        char msg[TS_MAX_ERRMSG];
        oom_message(srv, cost, msg, sizeof(msg));
        tsd_reply_msg(c, c->cur.opcode, c->cur.request_id, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
        upload_timed(c);
        return;
    }
    if (c->cur_reserved > cost)
        tsd_store_unreserve(&srv->store, c->cur_reserved - cost);
    c->cur_reserved = 0;
    int ran = item_dispatch(c, it, len);
    tsd_store_unreserve(&srv->store, extra);
    if (ran)
        upload_timed(c);
}

/*
 * 1 when the upload's rest is a message rather than a record: an SVC_REPLY with a status other
 * than OK (msg_svc.h). Such a message is 1 to TS_MAX_ERRMSG bytes and is not validated.
 */
static int carries_message(uint8_t op, const uint8_t *fixed)
{
    return op == TS_OP_SVC_REPLY && ts__msg_svc_reply_is_error(fixed);
}

/* A message-carrying upload (carries_message) of a length out of bounds: BAD_REQUEST. */
static int message_len_bad(tsd_conn *c, uint8_t op, uint32_t rid, uint64_t len)
{
    if (len >= 1 && len <= TS_MAX_ERRMSG)
        return 0;
    tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST,
                  "%s with an error status carries a message of 1 to %d bytes, not %llu",
                  ts__op_name(op), TS_MAX_ERRMSG, (unsigned long long)len);
    return 1;
}

static void fail_bad_record(tsd_conn *c, size_t len)
{
    tsd_conn_fail(c, c->cur.opcode, c->cur.request_id, TS_ST_BAD_RECORD,
                  "the %zu-byte record failed validation", len);
}

/*
 * A PUT/APPEND record shorter than a record header: BAD_RECORD, whether its body came raw or
 * compressed (a body too short for its name is BAD_REQUEST, also either way).
 */
static void fail_short_record(tsd_conn *c, uint8_t op, uint32_t rid, uint64_t rlen)
{
    tsd_conn_fail(c, op, rid, TS_ST_BAD_RECORD,
                  "record of %llu bytes is shorter than a record header", (unsigned long long)rlen);
}

/* Results of off-loop work (job.rc). */
enum { JOB_OK = 0, JOB_BAD_LZ4, JOB_SHORT, JOB_SHORT_RECORD, JOB_BAD_RECORD, JOB_LONG_MESSAGE };

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
        ts__msg_put_req m;
        if (ts__msg_upload_decode(data, raw, ts__msg_op_info(c->cur.opcode)->upload_fixed, &m) !=
            0) {
            c->job.rc = JOB_SHORT;
            return;
        }
        if (carries_message(c->cur.opcode, m.fixed)) {
            /* Off the loop only when inflating to TSD_OFFLOOP_MIN bytes: far past a message. */
            c->job.rc = JOB_LONG_MESSAGE;
            c->job.raw = (size_t)m.rec_len;
            return;
        }
        if (m.rec_len < TS_REC_HDR_SIZE) {
            c->job.rc = JOB_SHORT_RECORD;
            c->job.raw = (size_t)m.rec_len; /* the record's length, for job_done's message */
            return;
        }
        /* cur_name and cur_fixed are not touched on the loop thread while the job is busy. */
        tsd_item_set_len(it, (size_t)m.rec_len);
        memmove(c->cur_name, m.name, m.name_len);
        c->cur_name_len = (uint8_t)m.name_len;
        if (m.fixed_len > 0)
            memmove(c->cur_fixed, m.fixed, m.fixed_len);
        c->cur_fixed_len = (uint8_t)m.fixed_len;
        memmove(data, m.record, (size_t)m.rec_len);
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
    /*
     * Closed, canceled, or tensord is stopping: the request was answered SHUTTING_DOWN already
     * (tsd_conn_stop), and the store may be gone, so the record is dropped, never stored.
     */
    if (c->closing || status != 0 || srv->stopping) {
        tsd_item_unref(it);
        tsd_store_unreserve(&srv->store, c->cur_reserved);
        c->cur_reserved = 0;
        if (c->free_after) {
            tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): freed once its off-loop work returned",
                    (unsigned long long)c->id, c->peer);
            conn_free(c);
        } else if (!c->closing && !srv->stopping) {
            tsd_conn_close(c);
        }
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
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "%s body shorter than its name",
                      ts__op_name(op));
        break;
    case JOB_SHORT_RECORD:
        tsd_item_unref(it);
        fail_short_record(c, op, rid, c->job.raw);
        break;
    case JOB_LONG_MESSAGE:
        tsd_item_unref(it);
        (void)message_len_bad(c, op, rid, c->job.raw);
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
    if (!c->closing && c->rstate != TSD_RS_WORK && read_on(c) != 0)
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
    c->job.req.data = c;
    if (uv_queue_work(c->srv->loop, &c->job.req, job_work, job_done) != 0) {
        c->job.it = NULL;
        c->job.tmp = NULL;
        return -1;
    }
    c->job.busy = 1;
    c->rstate = TSD_RS_WORK;
    tsd_read_stop(c);
    return 0;
}

void tsd_conn_hold(tsd_conn *c, uint8_t op, uint32_t rid)
{
    /* Like off-loop upload work: process_input stops at TSD_RS_WORK and nothing more is read. */
    c->held = 1;
    c->held_op = op;
    c->held_rid = rid;
    if (c->rstate == TSD_RS_HDR)
        c->rstate = TSD_RS_WORK;
    tsd_read_stop(c);
}

void tsd_conn_release(tsd_conn *c)
{
    c->held = 0;
    if (c->closing) {
        if (c->free_after) {
            tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): freed once its held request was answered",
                    (unsigned long long)c->id, c->peer);
            conn_free(c);
        }
        return;
    }
    /* Frames that came in behind the held one, then the socket again (as job_done does). */
    if (c->rstate == TSD_RS_WORK)
        c->rstate = TSD_RS_HDR;
    if (c->rstate == TSD_RS_HDR)
        process_input(c);
    c->last_input_ms = uv_now(c->srv->loop);
    if (!c->closing && c->rstate != TSD_RS_WORK && read_on(c) != 0)
        tsd_conn_close(c);
}

/*
 * The buffer an upload of len bytes (a record, or a compressed body's inflated size) is received
 * into: a --data-dir file when the data directory takes it (PUT, APPEND and PUT_IF: the uploads
 * that become a bin's item); PUT and APPEND records of at least --shm-min bytes on a unix socket
 * go to a memfd, so that GET_REF can hand them out without a copy; the rest (and any upload when
 * no memfd can be had) to the heap.
 * The caller may lower the length afterwards (tsd_item_set_len).
 */
static tsd_item *upload_item(tsd_conn *c, size_t len, int *disk_rc)
{
    tsd_item *it = NULL;
    *disk_rc = 0;
    uint8_t op = c->cur.opcode;
    if (op == TS_OP_PUT || op == TS_OP_APPEND || op == TS_OP_PUT_IF) {
        /* With --data-dir, a file of the data directory first (datadir.c). */
        int rc = tsd_datadir_alloc(c->srv, len, &it);
        if (rc == 0)
            return it;
        if (rc < 0) {
            *disk_rc = rc;
            return NULL;
        }
    }
    if (op == TS_OP_PUT || op == TS_OP_APPEND) {
        /*
         * Only uploads on unix sockets that may carry descriptors: a client on this host is the
         * one that may read them by reference. A memfd's pages are small ones (tmpfs gives huge
         * pages only when configured), which costs receiving about a fifth more CPU than the
         * heap's huge pages, a price uploads nobody can map would pay for nothing.
         */
        if (c->is_unix && !c->srv->cfg.no_fds)
            it = tsd_shm_upload_item(c->srv, len);
    }
    return it != NULL ? it : tsd_item_new_sized(len);
}

/* A record has fully arrived in c->cur_item: validate it once and hand it to the store. */
static void item_done(tsd_conn *c)
{
    tsd_item *it = c->cur_item;
    c->cur_item = NULL;
    c->rstate = TSD_RS_HDR;
    size_t len = tsd_item_len(it);
    if (carries_message(c->cur.opcode, c->cur_fixed)) {
        item_store(c, it); /* a message, checked for its length when its head came */
        return;
    }
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
        tsd_conn_drop_upload(c);
        srv->stats.oom_rejections++;
        srv->stats.ops[op]++;
        char msg[TS_MAX_ERRMSG];
        oom_message(srv, raw, msg, sizeof(msg));
        tsd_reply_msg(c, op, rid, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
        return;
    }
    c->cur_reserved += raw;
    int disk_rc;
    tsd_item *it = upload_item(c, raw, &disk_rc);
    if (it == NULL && disk_rc != 0) {
        tsd_conn_drop_upload(c);
        srv->stats.oom_rejections++;
        srv->stats.ops[op]++;
        char dmsg[TS_MAX_ERRMSG];
        tsd_datadir_refusal(srv, disk_rc, raw, dmsg, sizeof(dmsg));
        tsd_reply_msg(c, op, rid, TS_ST_OUT_OF_MEMORY, dmsg, strlen(dmsg));
        return;
    }
    if (it == NULL) {
        tsd_conn_drop_upload(c);
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
    ts__msg_put_req m;
    if (ts__msg_upload_decode(data, raw, ts__msg_op_info(op)->upload_fixed, &m) != 0) {
        tsd_item_unref(it);
        tsd_conn_fail(c, op, rid, TS_ST_BAD_REQUEST, "%s body shorter than its name",
                      ts__op_name(op));
        return;
    }
    if (carries_message(op, m.fixed)) {
        if (message_len_bad(c, op, rid, m.rec_len)) {
            tsd_item_unref(it);
            return;
        }
    } else if (m.rec_len < TS_REC_HDR_SIZE) {
        tsd_item_unref(it);
        fail_short_record(c, op, rid, m.rec_len);
        return;
    }
    memcpy(c->cur_name, m.name, m.name_len);
    c->cur_name_len = (uint8_t)m.name_len;
    if (m.fixed_len > 0)
        memcpy(c->cur_fixed, m.fixed, m.fixed_len);
    c->cur_fixed_len = (uint8_t)m.fixed_len;
    /* Move the record to the start of the buffer, where tensor data is 64-byte aligned. */
    tsd_item_set_len(it, (size_t)m.rec_len);
    memmove(data, m.record, (size_t)m.rec_len);
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
    uint64_t limit = ts__msg_op_info(h->opcode)->upload ? c->srv->cfg.max_frame : TS_MAX_CTRL_BODY;
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
 * Check a header (ts__msg_request_check decides; this only words the reply). Returns 0 and fills
 * *h when the frame may proceed; otherwise the connection has been failed (error reply queued,
 * reading stopped) and -1 is returned.
 */
static int check_header(tsd_conn *c, const uint8_t *p, ts__hdr *h)
{
    const tsd_config *cfg = &c->srv->cfg;
    ts__msg_conn_state st = {.helloed = c->helloed, .lz4 = c->lz4, .max_frame = cfg->max_frame};
    ts__msg_hdr_rule rule;
    uint16_t status = ts__msg_request_check(p, &st, h, &rule);
    if (status == TS_ST_OK)
        return 0;
    uint8_t op = p[2];
    uint32_t rid = ts__get_u32le(p + 8);
    unsigned long long body_len = (unsigned long long)ts__get_u64le(p + 16);
    switch (rule) {
    case TS_HDR_MAGIC:
        tsd_conn_fail(c, op, rid, status, "bad magic 0x%02x (expected 0x%02x)", p[0], TS_MAGIC_REQ);
        break;
    case TS_HDR_VERSION:
        tsd_conn_fail(c, op, rid, status,
                      "frame version %u is not supported (this server speaks %u)", p[1],
                      TS_PROTO_VERSION);
        break;
    case TS_HDR_FLAGS:
        tsd_conn_fail(c, op, rid, status, "unknown header flags 0x%02x", p[3]);
        break;
    case TS_HDR_RESERVED:
        tsd_conn_fail(c, op, rid, status, "reserved header fields must be 0");
        break;
    case TS_HDR_STATUS:
        tsd_conn_fail(c, op, rid, status, "status must be 0 in a request");
        break;
    case TS_HDR_PREAUTH_SIZE:
        tsd_conn_fail(c, op, rid, status, "body of %llu bytes before HELLO (limit %d)", body_len,
                      TS_MAX_PREAUTH_BODY);
        break;
    case TS_HDR_NOT_HELLO:
        tsd_conn_fail(c, op, rid, status, "%s before HELLO: HELLO must come first",
                      ts__op_name(op));
        break;
    case TS_HDR_LZ4:
        tsd_conn_fail(c, op, rid, status, "lz4 body without negotiating it in HELLO");
        break;
    case TS_HDR_MAX_FRAME:
        tsd_conn_fail(c, op, rid, status, "body of %llu bytes exceeds the limit of %llu", body_len,
                      (unsigned long long)cfg->max_frame);
        break;
    case TS_HDR_OPCODE:
        tsd_conn_fail(c, op, rid, status, "unknown opcode 0x%02x", op);
        break;
    case TS_HDR_CTRL_SIZE:
    default:
        tsd_conn_fail(c, op, rid, status, "%s body of %llu bytes (limit %d)", ts__op_name(op),
                      body_len, TS_MAX_CTRL_BODY);
        break;
    }
    return -1;
}

/* A complete control frame (header at p, body after it); lz4 bodies are inflated first. */
static void control_frame(tsd_conn *c, const ts__hdr *h, const uint8_t *body)
{
    size_t len = (size_t)h->body_len;
    if (!(h->flags & TS_FLAG_LZ4)) {
        tsd_op_dispatch(c, h, body, len);
        return;
    }
    uint8_t raw[TS_MAX_CTRL_BODY];
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
 * Reserve the first step of a bulk body of total bytes (the rest follows as it arrives, see
 * reserve_ahead). 0, or -1 when the limit is reached: the body is being skipped, then answered
 * OUT_OF_MEMORY.
 */
static int reserve_first(tsd_conn *c, uint64_t total)
{
    tsd_store *st = &c->srv->store;
    c->bulk_total = total;
    c->cur_reserved = 0;
    c->cur_step = TSD_UPLOAD_FIRST;
    uint64_t first = total < TSD_UPLOAD_FIRST ? total : TSD_UPLOAD_FIRST;
    /*
     * Uploads in progress share at most a part of the limit, so that unfinished (perhaps
     * trickling) bodies cannot keep out uploads that arrive whole; finished items may use the rest.
     * The share is checked at the header only, and only while other uploads hold some: one upload
     * alone may still grow to the whole limit.
     */
    if (st->max_memory != 0 && st->reserved != 0 &&
        st->reserved + first > st->max_memory / TSD_UPLOAD_SHARE_DIV) {
        c->cur_capped = 1;
        start_discard(c, total);
        return -1;
    }
    if (tsd_store_reserve(st, first) != 0) {
        start_discard(c, total);
        return -1;
    }
    c->cur_reserved = first;
    return 0;
}

/* The buffer of a bulk body of total bytes could not be allocated: skip it, then refuse it. */
static void bulk_alloc_failed(tsd_conn *c, uint64_t total)
{
    tsd_conn_drop_upload(c);
    c->srv->stats.out_of_memory++;
    c->cur_alloc_failed = 1;
    start_discard(c, total);
}

/*
 * Receive a bulk body of total bytes into dst (an item, TSD_RS_ITEM, or the compressed buffer,
 * TSD_RS_LZ4): the bytes already buffered first, then straight from the socket (on_alloc).
 */
static void bulk_begin(tsd_conn *c, uint8_t *dst, uint64_t total, int rstate)
{
    size_t got = take_buffered(c, dst, total);
    c->bulk_dst = dst + got;
    c->bulk_left = total - got;
    c->rstate = rstate;
    if (c->bulk_left > 0)
        (void)reserve_ahead(c);
    else if (rstate == TSD_RS_ITEM)
        item_done(c);
    else
        lz4_done(c);
}

/*
 * Start a compressed PUT/APPEND once its raw length is buffered: check it, reserve, and read the
 * compressed body into a temporary buffer (lz4_done inflates it). Returns 1 when more input is
 * needed before anything can be decided, else 0.
 */
static int start_upload_lz4(tsd_conn *c, const ts__hdr *h)
{
    const uint8_t *body = c->ibuf + c->ipos + TS_HDR_SIZE;
    size_t avail = c->ilen - c->ipos - TS_HDR_SIZE;
    uint64_t blen = h->body_len;

    if (blen < TS_LZ4_PREFIX + 1) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "compressed body too short");
        return 0;
    }
    if (avail < TS_LZ4_PREFIX)
        return 1;
    uint64_t raw = ts__get_u64le(body);
    if (check_raw_len(c, h, raw) != 0)
        return 0;
    /*
     * A body without a name, as for a raw one. A record too short for its header is known only
     * once the name's length is (after inflating): then BAD_RECORD, as for a raw body.
     */
    if (raw < 1) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "%s body without a name",
                      ts__op_name(h->opcode));
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
    if (reserve_first(c, blen) != 0)
        return 0;
    c->cur_tmp = ts__malloc((size_t)blen);
    if (c->cur_tmp == NULL) {
        bulk_alloc_failed(c, blen);
        return 0;
    }
    c->cur_tmp_len = (size_t)blen;
    bulk_begin(c, c->cur_tmp, blen, TSD_RS_LZ4);
    return 0;
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
    c->up_t0 = c->t_in; /* its latency runs from here (a later call, a later read, moves it) */

    /* Snapshots are failing (--stop-writes-on-save-error): nothing reserved, body skipped. */
    if (tsd_writes_refused(srv) && ts__msg_op_info(h->opcode)->changes) {
        c->cur = *h;
        c->ipos += TS_HDR_SIZE;
        c->cur_refused = 1;
        start_discard(c, blen);
        return 0;
    }

    if (h->flags & TS_FLAG_LZ4)
        return start_upload_lz4(c, h);

    ts__msg_put_req m;
    size_t fixed = ts__msg_op_info(h->opcode)->upload_fixed;
    int rc = ts__msg_upload_head_decode(body, avail, blen, fixed, &m);
    if (rc == TS_EAGAIN)
        return 1;
    if (rc != 0) {
        const char *what = blen < 1     ? "without a name"
                           : fixed == 0 ? "shorter than its name"
                                        : "shorter than its name and fixed fields";
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "%s body %s",
                      ts__op_name(h->opcode), what);
        return 0;
    }
    /* Kept now for every path below (a refused STREAM_APPEND's reply, the handler). */
    if (m.fixed_len > 0)
        memcpy(c->cur_fixed, m.fixed, m.fixed_len);
    c->cur_fixed_len = (uint8_t)m.fixed_len;
    uint64_t rlen = m.rec_len;
    /* EMB_PULL and EMB_PUSH name a table every shard holds: its rows are spread by id. */
    int by_id = h->opcode == TS_OP_EMB_PULL || h->opcode == TS_OP_EMB_PUSH;
    if (!by_id && tsd_shard_foreign(srv, m.name, m.name_len)) {
        /* Another shard's name: nothing reserved, the rest read and dropped, then WRONG_SHARD. */
        c->cur = *h;
        memcpy(c->cur_name, m.name, m.name_len);
        c->cur_name_len = (uint8_t)m.name_len;
        c->ipos += TS_HDR_SIZE + m.head_len;
        c->cur_wrong_shard = 1;
        start_discard(c, rlen);
        return 0;
    }
    if (h->opcode == TS_OP_STREAM_APPEND || h->opcode == TS_OP_TABLE_INSERT) {
        /* A missing stream, a plain bin's name, no credit; a missing table, a bad priority or
         * reserved field, a rate limiter that holds inserts back with timeout 0: decided now,
         * answered once the record has been read and dropped unchecked (nothing is reserved for
         * it). */
        uint16_t status =
            h->opcode == TS_OP_STREAM_APPEND
                ? tsd_stream_append_check(srv, m.name, m.name_len)
                : tsd_table_insert_check(srv, m.name, m.name_len, m.fixed, m.fixed_len);
        if (status != 0) {
            c->cur = *h;
            memcpy(c->cur_name, m.name, m.name_len);
            c->cur_name_len = (uint8_t)m.name_len;
            c->ipos += TS_HDR_SIZE + m.head_len;
            c->cur_stream_status = status;
            start_discard(c, rlen);
            return 0;
        }
    }
    if (carries_message(h->opcode, m.fixed)) {
        if (message_len_bad(c, h->opcode, h->request_id, rlen))
            return 0;
    } else if (rlen < TS_REC_HDR_SIZE) {
        fail_short_record(c, h->opcode, h->request_id, rlen);
        return 0;
    }
    c->cur = *h;
    memcpy(c->cur_name, m.name, m.name_len);
    c->cur_name_len = (uint8_t)m.name_len;
    c->ipos += TS_HDR_SIZE + m.head_len;
    /*
     * The record goes straight into its item buffer, allocated whole now (untouched pages cost
     * nothing), while the reservation follows the bytes as they arrive (reserve_ahead): a client
     * that declares a huge body and stalls holds one step, not the whole length.
     */
    c->cur_raw_len = rlen;
    if (reserve_first(c, rlen) != 0)
        return 0;
    int disk_rc;
    c->cur_item = upload_item(c, (size_t)rlen, &disk_rc);
    if (c->cur_item == NULL) {
        if (disk_rc != 0) {
            /* Refused by --max-disk (or a file that could not be made): skip the body. */
            tsd_conn_drop_upload(c);
            c->cur_disk_rc = disk_rc;
            start_discard(c, rlen);
            return 0;
        }
        bulk_alloc_failed(c, rlen);
        return 0;
    }
    bulk_begin(c, tsd_item_data(c->cur_item), rlen, TSD_RS_ITEM);
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
        /* PUT, APPEND and the row uploads (GATHER_ROWS, WRITE_ROWS): name, then a record. */
        if (ts__msg_op_info(h.opcode)->upload) {
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
        /* The by-reference requests need descriptors both ways: only with HELLO FDS. */
        unsigned nfds = ts__msg_request_fds(h.opcode);
        if ((nfds > 0 || h.opcode == TS_OP_GET_REF || h.opcode == TS_OP_PEEK_REF) && !c->fds_ok) {
            tsd_conn_fail(c, h.opcode, h.request_id, TS_ST_BAD_REQUEST,
                          "%s on a connection without descriptors (HELLO flag FDS, unix "
                          "sockets only)",
                          ts__op_name(h.opcode));
            break;
        }
        if (nfds > 0) {
            /* The descriptor came with the frame's bytes, so it is queued by now. */
            c->claimed_fd = fds_claim(c);
            if (c->claimed_fd < 0) {
                tsd_conn_fail(c, h.opcode, h.request_id, TS_ST_BAD_REQUEST,
                              "%s frame without its descriptor", ts__op_name(h.opcode));
                break;
            }
        }
        control_frame(c, &h, body);
        if (c->srv->stats.timing) /* from the read that completed the frame to its reply */
            tsd_latency_observe(&c->srv->stats, h.opcode, ts__now_ns() - c->t_in);
        if (c->claimed_fd >= 0) {
            /* The handler did not take it (an error reply): it is closed, not kept. */
            (void)close(c->claimed_fd);
            c->claimed_fd = -1;
        }
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
        tsd_read_stop(c);
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
            tsd_read_stop(c);
            c->eof = 1;
            tsd_conn_begin_closing(c);
            tsd_conn_maybe_finish(c);
        } else {
            tsd_conn_close(c);
        }
        tsd_server_flush(srv);
        return;
    }
    if (c->is_unix && take_fds(c) != 0) {
        tsd_server_flush(srv);
        return;
    }
    if (nread == 0)
        return;
    srv->stats.bytes_received += (uint64_t)nread;
    c->last_input_ms = uv_now(srv->loop);
    if (srv->stats.timing)
        c->t_in = ts__now_ns();
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
 * Stopping
 */

/* Answer the request (op, rid) SHUTTING_DOWN: it was not carried out and never will be. */
static void reply_shutting_down(tsd_conn *c, uint8_t op, uint32_t rid)
{
    tsd_reply_msg(c, op, rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG, sizeof(TSD_SHUTDOWN_MSG) - 1);
}

/*
 * Answer SHUTTING_DOWN the requests whose frames are whole in the input buffer (behind a held
 * request or off-loop work), in order; stop at the first that is not whole or whose header
 * breaks a rule (it would have closed the connection). Returns how many were answered.
 */
static size_t answer_buffered(tsd_conn *c)
{
    size_t n = 0;
    if (c->ibuf == NULL)
        return 0;
    ts__msg_conn_state st = {
        .helloed = c->helloed, .lz4 = c->lz4, .max_frame = c->srv->cfg.max_frame};
    while (c->ilen - c->ipos >= TS_HDR_SIZE) {
        ts__hdr h;
        ts__msg_hdr_rule rule;
        if (ts__msg_request_check(c->ibuf + c->ipos, &st, &h, &rule) != TS_ST_OK ||
            c->ilen - c->ipos - TS_HDR_SIZE < h.body_len)
            break;
        c->ipos += TS_HDR_SIZE + (size_t)h.body_len;
        reply_shutting_down(c, h.opcode, h.request_id);
        n++;
    }
    return n;
}

size_t tsd_conn_stop(tsd_conn *c)
{
    tsd_server *srv = c->srv;
    if (c->closing)
        return 0;
    if (c->close_after_flush) {
        /* Told why it closes already: its waiters and subscriptions just go. */
        tsd_notify_conn_gone(srv, c);
        return 0;
    }
    /* WAITs set aside first: their replies may come in any order (PROTOCOL.md section 6). */
    size_t n = tsd_notify_conn_stop(srv, c);
    /* The request being served, when its reply is still to come. */
    if (c->held) {
        reply_shutting_down(c, c->held_op, c->held_rid);
        n++;
    } else if (c->job.busy || c->rstate == TSD_RS_ITEM || c->rstate == TSD_RS_LZ4 ||
               c->rstate == TSD_RS_DISCARD) {
        /* An upload: its record is dropped (off-loop work drops it when it returns). */
        reply_shutting_down(c, c->cur.opcode, c->cur.request_id);
        tsd_conn_drop_upload(c);
        c->cur_refused = 0;
        c->cur_alloc_failed = 0;
        c->cur_capped = 0;
        c->cur_disk_rc = 0;
        c->cur_stream_status = 0;
        c->cur_wrong_shard = 0;
        n++;
    }
    n += answer_buffered(c);
    tsd_conn_closing_frame(c, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG);
    /* Read on and drop what it still sends, so that closing does not reset the connection. */
    if (read_on(c) != 0)
        tsd_log(TSD_LOG_DEBUG, "conn %llu (%s): cannot drain its input while stopping",
                (unsigned long long)c->id, c->peer);
    return n;
}
