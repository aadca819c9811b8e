/*
 * The caller-side fast path of blocking calls: a blocking caller writes its own frame on the
 * socket and, when the I/O thread awaits nothing, reads its own reply, with no thread crossing.
 *
 * The caller enters through ts__submit_blocking_locked (write directly, or hand the request to
 * the I/O thread) and leaves through ts__self_read (read its own reply, when it was given the
 * reading side) or ts__direct_withdraw_locked (take the request back at its deadline); api.c's
 * wait_done calls nothing else here, and touches neither c->direct nor the socket. The rest is
 * the I/O thread's
 * side of the same hand-over: stopping direct writes before a socket closes, finishing a frame
 * the socket took only in part, giving the reading side away when nothing is awaited and taking
 * it back. The rules (who may touch what, under mu) are in docs/THREADING.md.
 */
#include "internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

/*
 * ms; a blocking receive on the calling thread gives up after this long, so that the caller
 * checks its deadline that often (see ts__fd_set_blocking)
 */
#define TS__RCV_SLICE_MS 50

/* ---------------------------------------------------------------------------------------------
 * Direct writes
 *
 * A blocking call spends most of a small round trip waking threads: handing its frame to the I/O
 * thread costs a wake-up before a byte leaves. So a blocking caller writes its frame on the
 * socket itself, holding mu, whenever the I/O thread has nothing in its inbox and no write of its
 * own under way (io_writes == 0): then no frame can be half written, and the I/O thread, which
 * takes mu before every write it starts, cannot start one in the middle of the caller's. Only
 * the reply crosses threads. The request waits in c->direct under an id with TS__DIRECT_ID set;
 * the I/O thread takes it from there when its reply arrives, or fails it when the connection
 * goes. When the socket takes only part of the frame, the rest is handed to the I/O thread
 * (c->handoff), which writes it before anything else.
 */

/*
 * Stop direct writes before the socket closes (the descriptor must not be written after it is
 * closed and perhaps reused). Returns the requests direct writes left waiting, for ts__fail_list.
 */
ts__req *ts__direct_stop(ts_client_t *c)
{
    ts__req *list = NULL;
    pthread_mutex_lock(&c->mu);
    if (c->rd_owner == TS__RD_CALLER) {
        /* A caller reads the socket: make its read end at once, and wait until it lets go. */
        shutdown(c->d_fd, SHUT_RDWR);
        while (c->rd_owner == TS__RD_CALLER)
            pthread_cond_wait(&c->rd_cond, &c->mu);
    }
    c->rd_owner = TS__RD_IO; /* a new connection starts with the I/O thread reading */
    c->fd_blocking = 0;      /* a new connection starts non-blocking */
    c->rd_want = 0;
    c->rd_broken = 0;
    c->pb_len = 0;
    c->d_ready = 0;
    c->d_fd = -1;
    if (c->handoff != NULL) {
        list = c->handoff;
        list->next = NULL;
        c->handoff = NULL;
        c->io_writes--;
    }
    for (size_t i = 0; i < c->direct.cap; i++) {
        if (c->direct.keys[i] == 0)
            continue;
        ts__req *r = c->direct.vals[i];
        r->bstate = TS__B_QUEUED; /* the I/O thread fails it (ts__fail_list) */
        r->next = list;
        list = r;
    }
    ts__idmap_free(&c->direct);
    pthread_mutex_unlock(&c->mu);
    return list;
}

/* The direct request waiting for the reply with this id, taken out of c->direct; or NULL. */
ts__req *ts__direct_take(ts_client_t *c, uint32_t id)
{
    if (!(id & TS__DIRECT_ID))
        return NULL;
    pthread_mutex_lock(&c->mu);
    ts__req *r = ts__idmap_del(&c->direct, id);
    if (r != NULL)
        r->bstate = TS__B_QUEUED; /* the I/O thread completes it */
    pthread_mutex_unlock(&c->mu);
    return r;
}

int ts__direct_withdraw_locked(ts_client_t *c, ts__req *r)
{
    if (r->bstate != TS__B_DIRECT)
        return 0; /* the I/O thread took it meanwhile (its reply, or a lost connection) */
    ts__idmap_del(&c->direct, r->id);
    r->bstate = TS__B_WITHDRAWN;
    return 1;
}

/*
 * Finish a direct write the socket took only part of: from now on r is an ordinary in-flight
 * request of the I/O thread (deadline, cut on timeout), its remaining bytes written by libuv.
 * io_writes already counts this write.
 */
void ts__write_handoff(ts_client_t *c, ts__req *r)
{
    ts__conn *conn = c->conn;
    if (c->state != TS__ST_READY || conn == NULL) {
        /* The connection went down after the caller wrote part of the frame. */
        ts__io_write_end(c);
        ts__req_finish(c, r, TS_ECONNRESET);
        return;
    }
    r->conn = conn;
    if (ts__idmap_put(&c->inflight, r->id, r) != 0) {
        ts__io_write_end(c);
        ts__req_finish(c, r, TS_ENOMEM);
        ts__conn_fail(c, conn, TS_ENOMEM, "out of memory");
        return;
    }
    r->in_map = 1;
    uv_buf_t bufs[TS__DIRECT_IOV];
    size_t n = ts__req_fill_bufs(r, bufs);
    size_t skip = r->woff;
    size_t i = 0;
    while (skip >= bufs[i].len) {
        skip -= bufs[i].len;
        i++;
    }
    bufs[i].base += skip;
    bufs[i].len -= skip;
    ts__req_write(c, conn, r, bufs + i, n - i);
}

/* Write r's frame on the socket from the calling thread (mu held). 1 when r is on its way. */
static int direct_write_locked(ts_client_t *c, ts__req *r)
{
    if (!c->d_ready || c->io_writes != 0 || c->inbox_head != NULL || r->sub != NULL ||
        r->body_len > c->d_max_body || ((r->hflags & TS_FLAG_LZ4) && !c->d_lz4) ||
        ts__req_nbufs(r) > TS__DIRECT_IOV)
        return 0;
    uint32_t id;
    do {
        id = c->d_next_id++ | TS__DIRECT_ID;
    } while (ts__idmap_get(&c->direct, id) != NULL);
    if (ts__idmap_put(&c->direct, id, r) != 0)
        return 0;
    ts__req_header(r, id);

    uv_buf_t bufs[TS__DIRECT_IOV];
    struct iovec iov[TS__DIRECT_IOV];
    size_t n = ts__req_fill_bufs(r, bufs);
    for (size_t i = 0; i < n; i++) {
        iov[i].iov_base = bufs[i].base;
        iov[i].iov_len = bufs[i].len;
    }
    uint64_t total = TS_HDR_SIZE + r->body_len;
    uint64_t sent = 0;
    size_t first = 0;
    for (;;) {
        struct msghdr m;
        memset(&m, 0, sizeof(m));
        m.msg_iov = iov + first;
        m.msg_iovlen = n - first;
        ssize_t k = sendmsg(c->d_fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            break; /* EAGAIN, or a broken connection that the I/O thread will notice */
        }
        sent += (uint64_t)k;
        if (sent == total)
            break;
        size_t left = (size_t)k;
        while (left >= iov[first].iov_len) {
            left -= iov[first].iov_len;
            first++;
        }
        iov[first].iov_base = (char *)iov[first].iov_base + left;
        iov[first].iov_len -= left;
    }
    if (sent == total) {
        r->bstate = TS__B_DIRECT;
        r->rlz4 = c->d_lz4;
        /*
         * When the I/O thread awaits nothing, the caller reads its reply itself too. Not for
         * WAIT and SAVE, whose answers may take long: other replies would wait behind them.
         */
        if (c->rd_owner == TS__RD_FREE && r->op != TS_OP_WAIT && r->op != TS_OP_SAVE) {
            c->rd_owner = TS__RD_CALLER;
            r->bstate = TS__B_SELF_READ;
            r->rfd = c->d_fd;
            r->rblock = c->fd_blocking;
        } else if (c->rd_owner == TS__RD_FREE) {
            c->rd_owner = TS__RD_IO; /* the I/O thread reads the reply: wake it to */
            uv_async_send(&c->async);
        }
        return 1;
    }
    ts__idmap_del(&c->direct, id);
    if (sent == 0)
        return 0; /* nothing went out: the I/O thread sends it the ordinary way */
    r->woff = (size_t)sent;
    r->wbusy = 1;
    c->handoff = r;
    c->io_writes++;
    uv_async_send(&c->async);
    return 1;
}

int ts__submit_blocking_locked(ts_client_t *c, ts__req *r)
{
    if (c->closing)
        return TS_ECANCELED;
    if (direct_write_locked(c, r)) {
        c->waiters++; /* until wait_done (api.c) lets go of the client */
        return 0;
    }
    return ts__submit_locked(c, r);
}

/* ---------------------------------------------------------------------------------------------
 * Reading replies on the calling thread
 *
 * A blocking caller that wrote its frame directly still had to be woken by the I/O thread once
 * the reply was in: one thread crossing per call. So when the I/O thread has nothing to wait
 * for (no request in flight, no subscription, nothing queued), it stops reading the socket
 * (ts__quiet_cb) and marks the reading side free; the next blocking caller takes it (rd_owner,
 * under mu, in direct_write_locked), reads its own reply (ts__self_read), and gives the socket
 * back free, or to the I/O thread when that has started to wait for something meanwhile
 * (rd_want) or when what arrived was not the caller's reply (the bytes read so far go back in
 * pb). While nobody reads, a duplicate of the socket is watched for the peer's hang-up only, so a
 * lost server is still noticed at once.
 */

static void hup_cb(uv_poll_t *p, int status, int events);

/* A caller gave up in the middle of a frame (rd_broken holds why): end the connection. */
void ts__conn_fail_broken(ts_client_t *c, int why)
{
    const char *msg = why == TS_EPROTO      ? "malformed reply from the server"
                      : why == TS_ETIMEDOUT ? "a reply was cut short by its request's deadline"
                      : why == TS_ENOMEM    ? "out of memory for a reply"
                                            : "the connection broke in the middle of a reply";
    ts__conn_fail(c, c->conn, why, msg);
}

/* The I/O thread reads the socket again (it holds the reading side). */
void ts__start_reading(ts_client_t *c)
{
    ts__conn *conn = c->conn;
    if (c->reading || conn == NULL || conn->closing)
        return;
    if (conn->hup_on) {
        uv_poll_stop(&conn->hup);
        conn->hup_on = 0;
    }
    ts__fd_set_blocking(c, 0); /* libuv reads and writes non-blocking */
    pthread_mutex_lock(&c->mu);
    int broken = c->rd_broken;
    size_t n = broken ? 0 : c->pb_len;
    if (n > 0)
        memcpy(conn->stage + conn->stage_len, c->pb, n);
    c->pb_len = 0;
    pthread_mutex_unlock(&c->mu);
    if (broken) {
        /* The stream is no longer at a frame boundary: never read on from there. */
        ts__conn_fail_broken(c, broken);
        return;
    }
    if (ts__read_start(c, conn) != 0)
        return;
    if (n > 0) {
        conn->stage_len += n;
        ts__process_stage(c, conn);
    }
}

/* The I/O thread has something to wait for: get the reading side back, now or from the caller. */
void ts__io_want_read(ts_client_t *c)
{
    if (c->reading || c->state != TS__ST_READY)
        return;
    pthread_mutex_lock(&c->mu);
    int take = c->rd_owner != TS__RD_CALLER;
    if (take)
        c->rd_owner = TS__RD_IO;
    else
        c->rd_want = 1;
    pthread_mutex_unlock(&c->mu);
    if (take)
        ts__start_reading(c);
}

static void hup_cb(uv_poll_t *p, int status, int events)
{
    ts__conn *conn = p->data;
    ts_client_t *c = conn->c;
    (void)status;
    (void)events;
    uv_poll_stop(p); /* level-triggered: it would fire again at once */
    conn->hup_on = 0;
    conn->hup_seen = 1; /* never quiet again: the end of the stream must be read */
    if (conn == c->conn)
        ts__io_want_read(c); /* reading finds the end of the stream (or a caller does) */
}

/* Before the loop waits: stop reading when nothing is awaited (see above). */
void ts__quiet_cb(uv_prepare_t *p)
{
    ts_client_t *c = p->data;
    ts__conn *conn = c->conn;
    if (!c->reading || c->state != TS__ST_READY || conn == NULL || conn->hup_fd < 0 ||
        conn->hup_seen || c->inflight.n != 0 || c->waitq_head != NULL ||
        conn->rstate != TS__RS_HDR || conn->stage_len != 0 || conn->discard != 0)
        return;
    pthread_mutex_lock(&c->mu);
    int idle = c->d_ready && c->rd_owner == TS__RD_IO && !c->rd_want && c->subs == NULL &&
               c->svcs == NULL && c->inbox_head == NULL && c->handoff == NULL && c->direct.n == 0;
    if (idle)
        c->rd_owner = TS__RD_FREE;
    pthread_mutex_unlock(&c->mu);
    if (!idle)
        return;
    uv_read_stop(&conn->u.stream);
    c->reading = 0;
    if (uv_poll_start(&conn->hup, UV_DISCONNECT, hup_cb) == 0) {
        conn->hup_on = 1;
        ts__fd_set_blocking(c, 1);
    } else {
        ts__io_want_read(c);
    }
}

/*
 * Put the socket in blocking mode or back (I/O thread; see fd_blocking). A blocking receive
 * gives up after TS__RCV_SLICE_MS, so a caller still checks its deadline that often.
 */
void ts__fd_set_blocking(ts_client_t *c, int on)
{
    pthread_mutex_lock(&c->mu);
    int was = c->fd_blocking;
    int fd = c->d_fd;
    pthread_mutex_unlock(&c->mu);
    if (was == on || fd < 0)
        return;
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0)
        return;
    if (on) {
        struct timeval tv = {0, TS__RCV_SLICE_MS * 1000};
        if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0 ||
            fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
            return;
    } else if (fcntl(fd, F_SETFL, fl | O_NONBLOCK) != 0) {
        return;
    }
    pthread_mutex_lock(&c->mu);
    c->fd_blocking = on;
    pthread_mutex_unlock(&c->mu);
}

/* Wait until fd is readable (or hung up): 1, 0 when the deadline passed, -1 on an error. */
static int wait_readable(int fd, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = ts__now_ns();
        if (now >= deadline_ns)
            return 0;
        uint64_t ms = (deadline_ns - now + 999999u) / 1000000u;
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int k = poll(&pfd, 1, ms > INT_MAX ? INT_MAX : (int)ms);
        if (k > 0)
            return 1;
        if (k < 0 && errno != EINTR)
            return -1;
    }
}

/* Why a read on the calling thread stopped short. */
enum { RR_OK = 0, RR_EOF, RR_ERR, RR_DEADLINE };

/*
 * Read between min and max bytes into buf (min: block for them). Returns bytes read; *why.
 * With ready, data is expected at once (the rest of a frame): recv first, poll only when the
 * socket runs dry; otherwise (a reply not yet sent) poll first, which saves a recv that would
 * find nothing.
 */
static size_t read_some(int fd, uint8_t *buf, size_t min, size_t max, uint64_t deadline, int ready,
                        int block, int *why)
{
    size_t got = 0;
    *why = RR_OK;
    while (got < min) {
        if (!ready && !block) {
            int w = wait_readable(fd, deadline);
            if (w <= 0) {
                *why = w == 0 ? RR_DEADLINE : RR_ERR;
                break;
            }
        }
        /* With block, the socket was in blocking mode: recv waits (a slice at most). */
        ssize_t k = recv(fd, buf + got, max - got, block && !ready ? 0 : MSG_DONTWAIT);
        if (k > 0) {
            got += (size_t)k;
            ready = 1;
        } else if (k == 0) {
            *why = RR_EOF;
            break;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (block && !ready && ts__now_ns() >= deadline) {
                *why = RR_DEADLINE;
                break;
            }
            if (block && !ready)
                block = 0; /* a slice passed, or the socket is non-blocking again: poll */
            ready = 0;
        } else if (errno != EINTR) {
            *why = RR_ERR;
            break;
        }
    }
    return got;
}

/*
 * Give the reading side back (mu held): free, or to the I/O thread when it waits for something
 * or has bytes to process.
 */
static void release_reading_locked(ts_client_t *c)
{
    if (c->rd_want || c->rd_broken || c->pb_len > 0 || c->direct.n > 0 || c->subs != NULL ||
        c->svcs != NULL || c->inbox_head != NULL || c->handoff != NULL) {
        c->rd_owner = TS__RD_IO;
        c->rd_want = 0;
        if (!c->closing)
            uv_async_send(&c->async);
    } else {
        c->rd_owner = TS__RD_FREE;
    }
    pthread_cond_broadcast(&c->rd_cond);
}

int ts__self_read(ts_client_t *c, ts__req *r)
{
    /* The reading side is this thread's: so is c->pb, which holds nothing (see ts__quiet_cb). */
    uint8_t *buf = c->pb;
    int why;
    int fd = r->rfd;
    size_t got =
        read_some(fd, buf, TS_HDR_SIZE, TS__STAGE_SIZE, r->deadline_ns, 0, r->rblock, &why);
    ts__hdr h;
    int mine = got >= TS_HDR_SIZE && ts__hdr_decode(buf, TS_MAGIC_REP, &h) == 0 &&
               h.opcode == r->op && h.request_id == r->id &&
               ts__reply_hdr_check(c, &h, r->rlz4) == 0;
    if (!mine) {
        /*
         * Not (all of) our reply: what was read stays for the I/O thread, which reads on; a
         * reply that is ours reaches r through c->direct as usual. So does everything that
         * breaks the protocol at the header (a malformed header, a body over its reply's bound,
         * a connection-level error): the I/O thread fails the connection and r with it, exactly
         * as if it had read the frame itself.
         */
        pthread_mutex_lock(&c->mu);
        /* Nobody else moves r while this thread holds the reading side: it is in c->direct. */
        int timeout = why == RR_DEADLINE;
        if (timeout)
            ts__idmap_del(&c->direct, r->id);
        r->bstate = timeout ? TS__B_WITHDRAWN : TS__B_DIRECT;
        c->pb_len = got;
        release_reading_locked(c);
        pthread_mutex_unlock(&c->mu);
        return timeout ? TS__SELF_TIMEOUT : TS__SELF_WAIT;
    }
    size_t blen = (size_t)h.body_len;
    size_t have = got - TS_HDR_SIZE;
    uint8_t *body = buf + TS_HDR_SIZE;
    int owned = 0;
    int status = 0;
    if (have < blen) {
        body = ts__malloc_aligned(blen);
        if (body == NULL) {
            status = TS_ENOMEM; /* the rest of the frame cannot be kept: the connection goes */
            why = RR_ERR;
        } else {
            owned = 1;
            memcpy(body, buf + TS_HDR_SIZE, have);
            have +=
                read_some(fd, body + have, blen - have, blen - have, r->deadline_ns, 1, 0, &why);
        }
    }
    size_t extra = have > blen ? have - blen : 0; /* the start of the next frame */
    int cut = have < blen;
    int malformed = 0;
    if (cut) {
        if (owned)
            ts__body_free(body, blen);
        if (status == 0)
            status = why == RR_DEADLINE ? TS_ETIMEDOUT : TS_ECONNRESET;
    } else {
        /* A body still in buf is parsed (or copied) before buf is handed on below. */
        status = ts__reply_apply(r, &h, body, blen, owned, &malformed);
    }
    pthread_mutex_lock(&c->mu);
    /* Ours since the header was read: nobody else takes a request out of c->direct meanwhile. */
    ts__idmap_del(&c->direct, r->id);
    if (cut && c->closing)
        status = TS_ECANCELED; /* ts_client_free shut the socket under us */
    if (cut || malformed) {
        /* Part of a frame is gone: the connection cannot go on. */
        c->rd_broken = malformed             ? TS_EPROTO
                       : why == RR_DEADLINE  ? TS_ETIMEDOUT
                       : status == TS_ENOMEM ? TS_ENOMEM
                                             : TS_ECONNRESET;
    } else if (extra > 0) {
        memmove(buf, buf + TS_HDR_SIZE + blen, extra);
        c->pb_len = extra;
    }
    release_reading_locked(c);
    r->status = status;
    r->bstate = TS__B_DONE;
    pthread_mutex_unlock(&c->mu);
    return TS__SELF_DONE;
}
