/*
 * Same-host zero copy, the client side (docs/PROTOCOL.md "Descriptors", GET_REF/PEEK_REF,
 * PUT_FD/APPEND_FD; docs/DESIGN.md "Same-host zero copy"):
 * - the descriptor lane: a second unix connection of the client, opened on first use with HELLO
 *   flag FDS, used by the by-reference calls only, one at a time under lane.mu, with its I/O on
 *   the calling thread (sendmsg/recvmsg with SCM_RIGHTS, poll with the request's deadline);
 * - ts_get_ref / ts_peek_ref: REF_ITEMS replies into ts_items_t whose records are read-only
 *   mappings of the descriptors the server sent (or inline in the reply body);
 * - shared buffers (ts_shared_t): a memfd holding an encoded record that the program writes in
 *   place, then hands to the server with PUT_FD/APPEND_FD.
 *
 * Descriptor hygiene: every descriptor this file receives is either mapped and closed, or closed
 * when its frame does not claim it; a malformed reply closes the lane and every descriptor that
 * came with it. Nothing here runs on the I/O thread, and the I/O thread never touches the lane.
 */
#define _GNU_SOURCE /* memfd_create, F_ADD_SEALS, MSG_CMSG_CLOEXEC */

#include "internal.h"

#include "auth.h"
#include "msg.h"
#include "sha256.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

/*
 * ms; after a server answered the lane's HELLO without FDS, by-reference calls copy for this
 * long before they ask again (a restarted server may grant it), instead of a HELLO per call
 */
#define LANE_NOFDS_RETRY_MS 10000
/* descriptors; the most one reply may carry (one per item, TS_MAX_REF_ITEMS items) */
#define LANE_MAX_FDS TS_MAX_REF_ITEMS
_Static_assert(TS_REF_MAX_ITEMS == TS_MAX_REF_ITEMS, "the public and the wire item limits differ");

/* The descriptors received while reading one frame, in arrival order. */
typedef struct fdq {
    int fds[LANE_MAX_FDS];
    size_t n;
    int overflow; /* more arrived than fit (or the kernel cut them): the frame is malformed */
} fdq;

static void fdq_close_from(fdq *q, size_t first)
{
    for (size_t i = first; i < q->n; i++)
        close(q->fds[i]);
    if (first < q->n)
        q->n = first;
}

/* ---------------------------------------------------------------------------------------------
 * The lane: setup and teardown
 */

void ts__lane_init(ts_client_t *c)
{
    pthread_mutex_init(&c->lane.mu, NULL);
    c->lane.fd = -1;
    c->lane.wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    c->lane.next_id = 1;
}

void ts__lane_cancel(ts_client_t *c)
{
    if (c->lane.wake_fd >= 0) {
        uint64_t one = 1;
        ssize_t n = write(c->lane.wake_fd, &one, sizeof(one));
        (void)n; /* a full counter is still readable, which is all a poll needs */
    }
}

void ts__lane_destroy(ts_client_t *c)
{
    if (c->lane.fd >= 0)
        close(c->lane.fd);
    c->lane.fd = -1;
    if (c->lane.wake_fd >= 0)
        close(c->lane.wake_fd);
    c->lane.wake_fd = -1;
    pthread_mutex_destroy(&c->lane.mu);
}

/* Close the lane (lane.mu held): the next call opens a new one. */
static void lane_close(ts_client_t *c)
{
    if (c->lane.fd >= 0)
        close(c->lane.fd);
    c->lane.fd = -1;
}

/*
 * Wait until fd is ready for events or the deadline passes (lane.mu held). 0 when ready (or hung
 * up: the read or write that follows finds out), TS_ETIMEDOUT, TS_ECANCELED (ts_client_free).
 */
static int lane_poll(ts_client_t *c, int fd, short events, uint64_t deadline_ns)
{
    for (;;) {
        uint64_t now = ts__now_ns();
        if (now >= deadline_ns)
            return TS_ETIMEDOUT;
        uint64_t left_ms = (deadline_ns - now + 999999u) / 1000000u;
        int wait_ms = left_ms > INT32_MAX ? INT32_MAX : (int)left_ms;
        struct pollfd p[2] = {{.fd = fd, .events = events},
                              {.fd = c->lane.wake_fd, .events = POLLIN}};
        int n = poll(p, c->lane.wake_fd >= 0 ? 2 : 1, wait_ms);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            return TS_ECONNRESET;
        if (c->lane.wake_fd >= 0 && (p[1].revents & POLLIN))
            return TS_ECANCELED;
        if (p[0].revents != 0)
            return 0;
    }
}

/*
 * Send len bytes of buf on the lane, attaching fd (>= 0) to the first byte as SCM_RIGHTS. 0, or
 * TS_ETIMEDOUT / TS_ECANCELED / TS_ECONNRESET (the lane must then be closed: a frame may be cut).
 */
static int lane_send(ts_client_t *c, const uint8_t *buf, size_t len, int fd, uint64_t deadline_ns)
{
    size_t off = 0;
    while (off < len) {
        struct iovec iov = {.iov_base = (void *)(buf + off), .iov_len = len - off};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int))];
        } ctl;
        if (off == 0 && fd >= 0) {
            memset(&ctl, 0, sizeof(ctl));
            mh.msg_control = ctl.space;
            mh.msg_controllen = sizeof(ctl.space);
            struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
            cm->cmsg_level = SOL_SOCKET;
            cm->cmsg_type = SCM_RIGHTS;
            cm->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(cm), &fd, sizeof(int));
        }
        ssize_t n = sendmsg(c->lane.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            off += (size_t)n;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int rc = lane_poll(c, c->lane.fd, POLLOUT, deadline_ns);
            if (rc != 0)
                return rc;
            continue;
        }
        return TS_ECONNRESET;
    }
    return 0;
}

/* Take the descriptors of every SCM_RIGHTS message in mh into q (closing what does not fit). */
static void take_fds(struct msghdr *mh, fdq *q)
{
    if (mh->msg_flags & MSG_CTRUNC)
        q->overflow = 1; /* the kernel dropped (and closed) descriptors that did not fit */
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(mh); cm != NULL; cm = CMSG_NXTHDR(mh, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS ||
            cm->cmsg_len < CMSG_LEN(0))
            continue;
        size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        const unsigned char *p = CMSG_DATA(cm);
        for (size_t i = 0; i < nfds; i++) {
            int fd;
            memcpy(&fd, p + i * sizeof(int), sizeof(int));
            if (q->n < LANE_MAX_FDS) {
                q->fds[q->n++] = fd;
            } else {
                close(fd);
                q->overflow = 1;
            }
        }
    }
}

/*
 * Read exactly len bytes into buf, collecting descriptors into q. 0, or TS_ECONNRESET (end of
 * stream, error), TS_ETIMEDOUT, TS_ECANCELED.
 */
static int lane_recv(ts_client_t *c, uint8_t *buf, size_t len, fdq *q, uint64_t deadline_ns)
{
    size_t off = 0;
    while (off < len) {
        struct iovec iov = {.iov_base = buf + off, .iov_len = len - off};
        union {
            struct cmsghdr h;
            char space[CMSG_SPACE(sizeof(int) * LANE_MAX_FDS)];
        } ctl;
        struct msghdr mh = {.msg_iov = &iov,
                            .msg_iovlen = 1,
                            .msg_control = ctl.space,
                            .msg_controllen = sizeof(ctl.space)};
        ssize_t n = recvmsg(c->lane.fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
        if (n > 0) {
            take_fds(&mh, q);
            off += (size_t)n;
            continue;
        }
        if (n == 0)
            return TS_ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            int rc = lane_poll(c, c->lane.fd, POLLIN, deadline_ns);
            if (rc != 0)
                return rc;
            continue;
        }
        return TS_ECONNRESET;
    }
    return 0;
}

/* One reply frame of the lane: its header, body (aligned allocation, or NULL) and descriptors. */
typedef struct lane_reply {
    ts__hdr h;
    uint8_t *body;
    size_t len;
    fdq q;
} lane_reply;

static void reply_clear(lane_reply *r)
{
    ts__free_aligned(r->body, r->len);
    r->body = NULL;
    r->len = 0;
    fdq_close_from(&r->q, 0);
}

/*
 * Send the request frame (op, body, fd >= 0 attached) and read its reply into *rep, the body of
 * an OK reply bounded by ok_limit bytes. 0 with the reply (any status: the caller reads it), or
 * an error after which the lane is closed and nothing is left in *rep (TS_EPROTO when the
 * server broke the protocol).
 */
static int lane_call(ts_client_t *c, uint8_t op, const uint8_t *body, size_t body_len, int fd,
                     uint64_t ok_limit, uint64_t deadline_ns, lane_reply *rep)
{
    memset(rep, 0, sizeof(*rep));
    uint8_t frame[TS_HDR_SIZE + TS_MAX_CTRL_BODY];
    if (body_len > TS_MAX_CTRL_BODY)
        return TS_EINVAL;
    uint32_t id = c->lane.next_id++;
    if (c->lane.next_id == 0)
        c->lane.next_id = 1;
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .request_id = id,
                 .body_len = body_len};
    ts__hdr_encode(&h, frame);
    if (body_len > 0)
        memcpy(frame + TS_HDR_SIZE, body, body_len);
    int rc = lane_send(c, frame, TS_HDR_SIZE + body_len, fd, deadline_ns);
    uint8_t hdr[TS_HDR_SIZE];
    if (rc == 0)
        rc = lane_recv(c, hdr, sizeof(hdr), &rep->q, deadline_ns);
    if (rc == 0) {
        /*
         * The header decides the body's bound before anything is allocated: the reply to this
         * request (or an error that belongs to no request, sent before the server closes), no
         * compression (the lane never asks for it), an OK body of at most ok_limit bytes and an
         * error body of at most TS_MAX_ERRMSG.
         */
        if (ts__hdr_decode(hdr, TS_MAGIC_REP, &rep->h) != 0 || rep->h.flags != 0)
            rc = TS_EPROTO;
        else if (rep->h.status == TS_ST_OK
                     ? rep->h.request_id != id || rep->h.opcode != op || rep->h.body_len > ok_limit
                     : (rep->h.request_id != id && rep->h.request_id != 0) ||
                           rep->h.body_len > TS_MAX_ERRMSG)
            rc = TS_EPROTO;
        else if (rep->h.body_len > SIZE_MAX)
            rc = TS_EPROTO;
    }
    if (rc == 0 && rep->h.body_len > 0) {
        rep->len = (size_t)rep->h.body_len;
        rep->body = ts__malloc_aligned(rep->len);
        if (rep->body == NULL) {
            rep->len = 0;
            rc = TS_ENOMEM; /* the body is still in the socket: the lane cannot go on */
        } else {
            rc = lane_recv(c, rep->body, rep->len, &rep->q, deadline_ns);
        }
    }
    if (rc == 0 && rep->q.overflow)
        rc = TS_EPROTO;
    if (rc != 0) {
        reply_clear(rep);
        lane_close(c);
    }
    return rc;
}

/* The opcode's name for messages. */
static const char *op_name(uint8_t op)
{
    switch (op) {
    case TS_OP_GET_REF:
        return "GET_REF";
    case TS_OP_PEEK_REF:
        return "PEEK_REF";
    case TS_OP_PUT_FD:
        return "PUT_FD";
    case TS_OP_APPEND_FD:
        return "APPEND_FD";
    case TS_OP_AUTH_CHALLENGE:
        return "AUTH_CHALLENGE";
    default:
        return "HELLO";
    }
}

/*
 * The failure of an error reply (status not OK): its message for ts_last_error() and its code.
 * Descriptors that came with it are closed (no error frame claims any); replies that end the
 * server's side of the connection close the lane too.
 */
static int reply_error(ts_client_t *c, uint8_t op, lane_reply *rep)
{
    ts__msg_error e;
    int err = ts__status_to_err(rep->h.status);
    if (ts__msg_error_decode(rep->body, rep->len, &e) == 0 && e.len > 0)
        ts__set_last_error(e.msg, e.len);
    else
        ts__set_errorf("%s: %s", op_name(op), ts__status_name(rep->h.status));
    uint16_t st = rep->h.status;
    if (rep->h.request_id == 0 ||
        !(st == TS_ST_NOT_FOUND || st == TS_ST_INVALID || st == TS_ST_OUT_OF_MEMORY ||
          st == TS_ST_NAME_TOO_LONG || st == TS_ST_WRONG_SHARD || st == TS_ST_SAVE_FAILING))
        lane_close(c);
    reply_clear(rep);
    return err;
}

/* Connect the lane's socket to the client's unix path. 0, TS_ECONNREFUSED (retry), or else. */
static int lane_connect(ts_client_t *c)
{
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    size_t plen = strlen(c->unix_path);
    if (plen >= sizeof(sa.sun_path))
        return ts__fail(TS_EINVAL,
                        "unix socket path of %zu bytes is too long for a descriptor lane", plen);
    memcpy(sa.sun_path, c->unix_path, plen);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return ts__fail(TS_ENOMEM, "no socket for the descriptor lane: %s", strerror(errno));
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        /* Missing, refused, a full backlog: "not now" all, which the caller retries. */
        close(fd);
        return TS_ECONNREFUSED;
    }
    c->lane.fd = fd;
    return 0;
}

/*
 * Make sure the lane is open and granted descriptors (lane.mu held). 0: open; 1: the server
 * does not grant descriptors (the caller copies instead); or an error.
 */
static int lane_ensure(ts_client_t *c, uint64_t deadline_ns)
{
    if (c->lane.fd >= 0) {
        /*
         * Between calls nothing may arrive on the lane: anything readable is the end of a
         * connection the server closed meanwhile (a restart), so open a new one now rather than
         * fail this call on a dead socket.
         */
        struct pollfd p = {.fd = c->lane.fd, .events = POLLIN};
        if (poll(&p, 1, 0) == 0)
            return 0;
        lane_close(c);
    }
    if (c->lane.no_fds_until != 0 && ts__now_ns() < c->lane.no_fds_until)
        return 1;
    /* Connect, retrying a refused connection (the server restarting) with the client's backoff. */
    int backoff = c->opts.reconnect_min_ms;
    int rc;
    for (;;) {
        rc = lane_connect(c);
        if (rc != TS_ECONNREFUSED)
            break;
        uint64_t now = ts__now_ns();
        if (now + (uint64_t)backoff * 1000000u >= deadline_ns)
            return ts__fail(TS_ETIMEDOUT, "descriptor lane: cannot connect to %s", c->address);
        /* Sleep in poll on the wake descriptor: ts_client_free cuts the wait short. */
        struct pollfd w = {.fd = c->lane.wake_fd, .events = POLLIN};
        if (poll(&w, c->lane.wake_fd >= 0 ? 1 : 0, backoff) > 0 && (w.revents & POLLIN))
            return ts__fail(TS_ECANCELED, "the client is closing");
        backoff = backoff * 2 > c->opts.reconnect_max_ms ? c->opts.reconnect_max_ms : backoff * 2;
    }
    if (rc != 0)
        return rc;
    /* With a token, the lane proves it as the main connection does (AUTH_CHALLENGE first). */
    uint8_t nonces[2 * TS_MSG_AUTH_NONCE_SIZE], tag[TS_MSG_TOKEN_PROOF_SIZE];
    lane_reply rep;
    if (c->token_len > 0) {
        if (ts__auth_nonce(nonces) != 0) {
            lane_close(c);
            return ts__fail(TS_EAGAIN, "descriptor lane: no random bytes for a nonce");
        }
        rc = lane_call(c, TS_OP_AUTH_CHALLENGE, nonces, TS_MSG_AUTH_NONCE_SIZE, -1,
                       TS_MSG_AUTH_NONCE_SIZE, deadline_ns, &rep);
        if (rc != 0)
            return ts__fail(rc, "descriptor lane: AUTH_CHALLENGE failed: %s", ts_strerror(rc));
        if (rep.h.status != TS_ST_OK || rep.len != TS_MSG_AUTH_NONCE_SIZE) {
            rc = rep.h.status != TS_ST_OK ? reply_error(c, TS_OP_AUTH_CHALLENGE, &rep) : TS_EPROTO;
            reply_clear(&rep);
            lane_close(c);
            return ts__fail(rc, "descriptor lane: AUTH_CHALLENGE failed: %s", ts_strerror(rc));
        }
        memcpy(nonces + TS_MSG_AUTH_NONCE_SIZE, rep.body, TS_MSG_AUTH_NONCE_SIZE);
        reply_clear(&rep);
        ts__auth_proof(c->token, c->token_len, TS_AUTH_CLIENT, nonces,
                       nonces + TS_MSG_AUTH_NONCE_SIZE, tag);
    }
    uint8_t body[TS_MSG_HELLO_REQ_FIXED + TS_MSG_TOKEN_PROOF_SIZE];
    ts__msg_hello_req m = {
        .max_version = TS_PROTO_VERSION,
        .flags = (uint8_t)(TS_HELLO_FDS | (c->token_len > 0 ? TS_HELLO_TOKEN_PROOF : 0)),
        .token_len = c->token_len > 0 ? (uint16_t)sizeof(tag) : 0,
        .token = c->token_len > 0 ? tag : NULL};
    size_t len;
    if (ts__msg_hello_req_encode(body, sizeof(body), &m, &len) != 0) {
        lane_close(c);
        return ts__fail(TS_EINVAL, "descriptor lane: HELLO cannot be encoded");
    }
    rc = lane_call(c, TS_OP_HELLO, body, len, -1, TS_MSG_HELLO_REP_SIZE + TS_MSG_TOKEN_PROOF_SIZE,
                   deadline_ns, &rep);
    if (rc != 0)
        return ts__fail(rc, "descriptor lane: HELLO failed: %s", ts_strerror(rc));
    if (rep.h.status != TS_ST_OK) {
        rc = reply_error(c, TS_OP_HELLO, &rep);
        lane_close(c);
        if (rc == TS_ETOOMANY) {
            /* The main connection got in, the lane did not (--max-clients): copy for now. */
            c->lane.no_fds_until = ts__now_ns() + (uint64_t)LANE_NOFDS_RETRY_MS * 1000000u;
            return 1;
        }
        return rc;
    }
    ts__msg_hello_rep hr;
    int bad =
        ts__msg_hello_rep_decode(rep.body, rep.len, &hr) != 0 || hr.version != TS_PROTO_VERSION;
    if (!bad && (hr.flags & TS_HELLO_TOKEN_PROOF)) {
        /* The server proves in turn that it knows the token. */
        uint8_t want[TS_MSG_TOKEN_PROOF_SIZE] = {0};
        if (c->token_len > 0)
            ts__auth_proof(c->token, c->token_len, TS_AUTH_SERVER, nonces,
                           nonces + TS_MSG_AUTH_NONCE_SIZE, want);
        if (c->token_len == 0 || !ts__ct_equal(want, hr.proof, sizeof(want))) {
            reply_clear(&rep);
            lane_close(c);
            return ts__fail(TS_EAUTH, "descriptor lane: the server's token proof is wrong");
        }
    }
    reply_clear(&rep); /* closes any descriptor that came with it: HELLO claims none */
    if (bad) {
        lane_close(c);
        return ts__fail(TS_EPROTO, "descriptor lane: malformed HELLO reply");
    }
    if (!(hr.flags & TS_HELLO_FDS)) {
        lane_close(c);
        c->lane.no_fds_until = ts__now_ns() + (uint64_t)LANE_NOFDS_RETRY_MS * 1000000u;
        return 1;
    }
    c->lane.no_fds_until = 0;
    c->lane.max_body = hr.max_body;
    return 0;
}

/*
 * Enter a by-reference call: count the caller as a user of c (so ts_client_free waits for it)
 * and take the lane. 0, or TS_ECANCELED when the client is closing.
 */
static int lane_enter(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    if (c->closing) {
        pthread_mutex_unlock(&c->mu);
        return ts__fail(TS_ECANCELED, "the client is closing");
    }
    c->waiters++;
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_lock(&c->lane.mu);
    return 0;
}

static void lane_leave(ts_client_t *c)
{
    pthread_mutex_unlock(&c->lane.mu);
    pthread_mutex_lock(&c->mu);
    if (--c->waiters == 0 && c->closing)
        pthread_cond_broadcast(&c->open_cond);
    pthread_mutex_unlock(&c->mu);
}

/* The deadline of a call made now: the client's request timeout. */
static uint64_t call_deadline(const ts_client_t *c)
{
    return ts__now_ns() + (uint64_t)c->opts.request_timeout_ms * 1000000u;
}

/* The checks every call shares (those of the copying calls). */
static int check_blocking(ts_client_t *c)
{
    if (c == NULL)
        return ts__fail(TS_EINVAL, "no client");
    if (ts__on_io_thread(c))
        return ts__fail(TS_EDEADLK, "blocking call made from a client callback");
    ts__set_last_error(NULL, 0);
    return 0;
}

/* ---------------------------------------------------------------------------------------------
 * By-reference reads
 */

static void unmap_fn(void *data, size_t len)
{
    munmap(data, len);
}

/*
 * Map entry e's record from descriptor fd (which this closes) and decode it: the tree, or NULL
 * with *rc (TS_EPROTO for a descriptor or record that breaks the rules, TS_ENOMEM).
 */
static ts_value_t *map_entry(int fd, const ts__msg_ref_entry *e, int *rc)
{
    *rc = TS_EPROTO;
    struct stat st;
    long page = sysconf(_SC_PAGESIZE);
    uint64_t end;
    if (page <= 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 0 ||
        __builtin_add_overflow(e->offset, e->length, &end) || end > (uint64_t)st.st_size ||
        e->length < TS_REC_HDR_SIZE || e->length > SIZE_MAX - (size_t)page) {
        /*
         * The file must hold the whole record now, or touching the mapping past its end would
         * raise SIGBUS. The server's memfds cannot shrink (sealed); data-dir files are opened
         * read-only and only the server writes them.
         */
        close(fd);
        return NULL;
    }
    /* Map from the page that holds the record's start (offsets are 4096-aligned anyway). */
    uint64_t delta = e->offset % (uint64_t)page;
    size_t map_len = (size_t)(e->length + delta);
    off_t map_off = (off_t)(e->offset - delta);
    void *p = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, map_off);
    if (p == MAP_FAILED && errno == EPERM) /* F_SEAL_WRITE on kernels before 6.7 */
        p = mmap(NULL, map_len, PROT_READ, MAP_PRIVATE, fd, map_off);
    int map_errno = errno;
    close(fd); /* the mapping keeps the pages */
    if (p == MAP_FAILED) {
        *rc = map_errno == ENOMEM ? TS_ENOMEM : TS_EPROTO;
        return NULL;
    }
    ts__rbuf *buf = ts__rbuf_new(p, map_len, unmap_fn);
    if (buf == NULL) {
        munmap(p, map_len);
        *rc = TS_ENOMEM;
        return NULL;
    }
    ts_value_t *v =
        ts__record_decode(buf, (size_t)delta, (size_t)e->length, TS_MAX_DEPTH, TS_MAX_NDIM);
    *rc = 0;
    if (v == NULL)
        *rc = ts__record_validate((const uint8_t *)p + delta, (size_t)e->length, TS_MAX_DEPTH,
                                  TS_MAX_NDIM, NULL) == 0
                  ? TS_ENOMEM
                  : TS_EPROTO;
    ts__rbuf_unref(buf); /* the tree holds it now (or nobody: unmapped) */
    return v;
}

/*
 * Turn an OK REF_ITEMS reply into items: takes over rep's body and descriptors in every case.
 * 0 and *out, or TS_EPROTO (malformed: the caller closes the lane) or TS_ENOMEM.
 */
static int ref_items(lane_reply *rep, ts_items_t **out)
{
    ts__msg_ref_items m;
    if (ts__msg_ref_decode(rep->body, rep->len, &m) != 0 || m.n_fds > rep->q.n) {
        reply_clear(rep);
        return TS_EPROTO;
    }
    /* Descriptors the frame does not claim (more than n_fds arrived) are not ours to keep. */
    fdq_close_from(&rep->q, m.n_fds);
    ts_items_t *items = ts__calloc(1, sizeof(*items) + (size_t)m.n_items * sizeof(ts_value_t *));
    ts__rbuf *body = NULL;
    if (items != NULL && rep->body != NULL) {
        body = ts__rbuf_new(rep->body, rep->len, NULL);
        if (body != NULL) {
            rep->body = NULL; /* the buffer owns it now */
            rep->len = 0;
        }
    }
    if (items == NULL || (rep->body != NULL && body == NULL)) {
        ts__free(items);
        reply_clear(rep);
        return TS_ENOMEM;
    }
    items->version = m.version;
    items->remaining = m.remaining;
    int rc = 0;
    size_t next_fd = 0;
    for (uint32_t i = 0; i < m.n_items && rc == 0; i++) {
        ts__msg_ref_entry e;
        ts__msg_ref_entry_get(&m, i, &e);
        ts_value_t *v;
        if (e.where == TS_REF_FD) {
            int fd = rep->q.fds[next_fd];
            rep->q.fds[next_fd++] = -1; /* map_entry closes it */
            v = map_entry(fd, &e, &rc);
        } else {
            v = ts__record_decode(body, (size_t)e.offset, (size_t)e.length, TS_MAX_DEPTH,
                                  TS_MAX_NDIM);
            if (v == NULL)
                rc = ts__record_validate(body->data + e.offset, (size_t)e.length, TS_MAX_DEPTH,
                                         TS_MAX_NDIM, NULL) == 0
                         ? TS_ENOMEM
                         : TS_EPROTO;
        }
        if (v != NULL)
            items->items[items->count++] = v;
    }
    /* Descriptors of entries not reached after a failure. */
    for (size_t i = next_fd; i < rep->q.n; i++)
        if (rep->q.fds[i] >= 0)
            close(rep->q.fds[i]);
    rep->q.n = 0;
    ts__rbuf_unref(body); /* the inline trees keep it alive */
    if (rc != 0) {
        ts_items_free(items);
        return rc;
    }
    *out = items;
    return 0;
}

static int fetch_ref(ts_client_t *c, uint8_t op, const char *bin, size_t max_items,
                     ts_items_t **out)
{
    int rc = check_blocking(c);
    if (rc != 0)
        return rc;
    if (bin == NULL || out == NULL)
        return ts__fail(TS_EINVAL, "bin and out are required");
    size_t name_len = strlen(bin);
    if (name_len > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", name_len,
                        TS_MAX_NAME_LEN);
    int copy = c->unix_path == NULL;
    if (!copy) {
        uint64_t deadline = call_deadline(c);
        rc = lane_enter(c);
        if (rc != 0)
            return rc;
        rc = lane_ensure(c, deadline);
        if (rc == 1) {
            copy = 1;
        } else if (rc == 0) {
            uint8_t body[TS_MAX_CTRL_BODY];
            size_t len;
            ts__msg_name_req m;
            memset(&m, 0, sizeof(m));
            m.name = (const uint8_t *)bin;
            m.name_len = name_len;
            m.max_items = max_items == 0 || max_items > TS_MAX_REF_ITEMS ? TS_MAX_REF_ITEMS
                                                                         : (uint32_t)max_items;
            rc = ts__msg_get_req_encode(body, sizeof(body), &m, &len);
            lane_reply rep;
            if (rc == 0)
                rc = lane_call(c, op, body, len, -1, c->opts.max_reply_bytes, deadline, &rep);
            if (rc == 0 && rep.h.status != TS_ST_OK) {
                rc = reply_error(c, op, &rep);
            } else if (rc == 0) {
                rc = ref_items(&rep, out);
                if (rc == TS_EPROTO) {
                    lane_close(c);
                    ts__fail(rc, "%s: malformed reply or descriptor from the server", op_name(op));
                }
            } else if (ts_last_error()[0] == '\0') {
                ts__fail(rc, "%s on the descriptor lane: %s", op_name(op), ts_strerror(rc));
            }
        }
        lane_leave(c);
        if (!copy)
            return rc;
    }
    return op == TS_OP_GET_REF ? ts_get(c, bin, max_items, out) : ts_peek(c, bin, max_items, out);
}

int ts_get_ref(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out)
{
    c = ts__route(c, bin);
    return fetch_ref(c, TS_OP_GET_REF, bin, max_items, out);
}

int ts_peek_ref(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out)
{
    c = ts__route(c, bin);
    return fetch_ref(c, TS_OP_PEEK_REF, bin, max_items, out);
}

/* ---------------------------------------------------------------------------------------------
 * Shared buffers
 */

/* Where a shared buffer is in its life. */
enum {
    SH_OPEN = 0, /* mapped writable: the program fills it */
    SH_SEALED,   /* withdrawn and sealed by the server, not stored: may be committed again */
    SH_DONE      /* committed: the server's */
};

struct ts_shared_s {
    int fd;           /* the memfd; -1 once committed */
    uint8_t *map;     /* the record's address range: writable while SH_OPEN, PROT_NONE after */
    size_t rec_len;   /* bytes of the record (and of the file) */
    ts_value_t *root; /* the decoded tree over map (holds the mapping through its buffer) */
    int state;
};

/* A tensor spec's zero mapping (ts_tensor_spec_new). */
typedef struct spec_map {
    void *p;
    size_t len;
} spec_map;

static void spec_release(void *owner)
{
    spec_map *m = owner;
    munmap(m->p, m->len);
    ts__free(m);
}

ts_value_t *ts_tensor_spec_new(ts_dtype_t dtype, int ndim, const int64_t *shape)
{
    /* The data's size, overflow-checked (ts_tensor_new_external checks the rest again). */
    if (ndim < 0 || ndim > TS_MAX_NDIM || (ndim > 0 && shape == NULL) || ts_dtype_size(dtype) == 0)
        return NULL;
    size_t bytes = ts_dtype_size(dtype);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0 || __builtin_mul_overflow(bytes, (size_t)shape[i], &bytes))
            return NULL;
    if (bytes == 0)
        return ts_tensor_new(dtype, ndim, shape, NULL, TS_BORROW);
    spec_map *m = ts__malloc(sizeof(*m));
    if (m == NULL)
        return NULL;
    /* Reads of a private anonymous mapping see the zero page: no memory until written. */
    m->p = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m->p == MAP_FAILED) {
        ts__free(m);
        return NULL;
    }
    m->len = bytes;
    ts_value_t *v = ts_tensor_new_external(dtype, ndim, shape, m->p, spec_release, m);
    if (v == NULL) {
        munmap(m->p, m->len);
        ts__free(m);
    }
    return v;
}

/* bytes; a shared buffer up to this size is prefaulted without looking at the free memory */
#define SHARED_PREFAULT_ALWAYS ((size_t)64 << 20)

/*
 * Whether to allocate a new shared buffer's pages when mapping it (MAP_POPULATE). The program is
 * about to write every tensor, and allocating the pages in one call costs less than a fault per
 * page (256 MiB: about 0.8 s instead of 1.2 s of first writes measured on the development VM,
 * where first-touch faults are slow for heap memory as well). But a memfd's pages are taken at
 * once and for good: a buffer larger than the memory left would run the machine out of memory
 * (the kernel's OOM killer) instead of failing or growing with the writes. So a buffer over
 * SHARED_PREFAULT_ALWAYS is prefaulted only when it is at most half of MemAvailable in
 * /proc/meminfo (reading it takes about 12 us, prefaulting 64 MiB about 60 ms); else, or when
 * that cannot be read, its pages come as they are first written.
 */
static int shared_prefault(size_t len)
{
    if (len <= SHARED_PREFAULT_ALWAYS)
        return 1;
    int fd = open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    char text[4096];
    ssize_t n = read(fd, text, sizeof(text) - 1);
    close(fd);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    const char *line = strstr(text, "\nMemAvailable:");
    if (line == NULL)
        return 0;
    char *end;
    unsigned long long kib = strtoull(line + strlen("\nMemAvailable:"), &end, 10);
    if (end == line + strlen("\nMemAvailable:") || kib > UINT64_MAX / 1024)
        return 0;
    return (uint64_t)len <= (uint64_t)kib * 1024 / 2;
}

/* Mark, in tree order (the encoder's), which data segments are tensors (1) or byte strings. */
static void seg_kinds(const ts_value_t *v, uint8_t *kinds, size_t *i)
{
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        for (size_t k = 0; k < v->len; k++)
            seg_kinds(v->u.c.items[k], kinds, i);
        break;
    case TS_TYPE_TENSOR:
        kinds[(*i)++] = 1;
        break;
    case TS_TYPE_BYTES:
        kinds[(*i)++] = 0;
        break;
    default:
        break;
    }
}

int ts_shared_new(const ts_value_t *layout, ts_shared_t **out)
{
    if (layout == NULL || out == NULL)
        return ts__fail(TS_EINVAL, "layout and out are required");
    ts__enc e;
    int rc = ts__record_plan(layout, &e);
    if (rc != 0)
        return ts__fail(rc, "the layout cannot be encoded: %s", ts__record_plan_why(rc));
    uint8_t *kinds = e.nsegs > 0 ? ts__malloc(e.nsegs) : NULL;
    ts_shared_t *sh = ts__calloc(1, sizeof(*sh));
    if (sh == NULL || (e.nsegs > 0 && kinds == NULL) || e.total > SIZE_MAX) {
        ts__free(kinds);
        ts__free(sh);
        ts__enc_free(&e);
        return ts__fail(TS_ENOMEM, NULL);
    }
    size_t nk = 0;
    seg_kinds(layout, kinds, &nk);
    sh->rec_len = (size_t)e.total;
    sh->fd = memfd_create("tensorshare-shared", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (sh->fd < 0) {
        rc = errno == ENOSYS || errno == EINVAL ? TS_ENOTSUP : TS_ENOMEM;
        ts__fail(rc, "memfd_create: %s", strerror(errno));
        goto fail;
    }
    if (ftruncate(sh->fd, (off_t)sh->rec_len) != 0) {
        rc = ts__fail(TS_ENOMEM, "cannot size the shared buffer to %zu bytes: %s", sh->rec_len,
                      strerror(errno));
        goto fail;
    }
    int flags = MAP_SHARED | (shared_prefault(sh->rec_len) ? MAP_POPULATE : 0);
    void *p = mmap(NULL, sh->rec_len, PROT_READ | PROT_WRITE, flags, sh->fd, 0);
    if (p == MAP_FAILED) {
        rc = ts__fail(TS_ENOMEM, "cannot map the shared buffer: %s", strerror(errno));
        goto fail;
    }
    sh->map = p;
    /* The file starts zeroed: write the head and the byte strings; tensors and padding stay 0. */
    memcpy(sh->map, e.head, e.head_len);
    size_t pos = e.head_len;
    for (size_t i = 0; i < e.nsegs; i++) {
        if (!kinds[i] && e.segs[i].len > 0)
            memcpy(sh->map + pos, e.segs[i].ptr, e.segs[i].len);
        pos += e.segs[i].len + e.segs[i].pad_after;
    }
    ts__rbuf *buf = ts__rbuf_new(sh->map, sh->rec_len, unmap_fn);
    if (buf == NULL) {
        munmap(sh->map, sh->rec_len);
        sh->map = NULL;
        rc = ts__fail(TS_ENOMEM, NULL);
        goto fail;
    }
    sh->root = ts__record_decode(buf, 0, sh->rec_len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(buf); /* the tree holds the mapping from now on (or it is unmapped) */
    if (sh->root == NULL) {
        sh->map = NULL;
        rc = ts__fail(TS_ENOMEM, NULL);
        goto fail;
    }
    ts__free(kinds);
    ts__enc_free(&e);
    *out = sh;
    return 0;
fail:
    if (sh->fd >= 0)
        close(sh->fd);
    ts__free(kinds);
    ts__free(sh);
    ts__enc_free(&e);
    return rc;
}

const ts_value_t *ts_shared_value(const ts_shared_t *sh)
{
    return sh == NULL || sh->state != SH_OPEN ? NULL : sh->root;
}

size_t ts_shared_size(const ts_shared_t *sh)
{
    return sh == NULL ? 0 : sh->rec_len;
}

/*
 * Withdraw the writable mapping: the same addresses become an inaccessible reservation (so a
 * stale pointer faults rather than reaching whatever a later mapping puts there), and the memfd
 * has no writable mapping left, which the server's F_SEAL_WRITE requires. 0 or TS_ENOMEM.
 */
static int shared_withdraw(ts_shared_t *sh)
{
    void *p = mmap(sh->map, sh->rec_len, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? TS_ENOMEM : 0;
}

/*
 * After a failed commit: writable again when the server did not seal the memfd (the buffer is
 * the program's again), else SH_SEALED (it can only be sent again, unchanged).
 */
static void shared_restore(ts_shared_t *sh)
{
    int seals = fcntl(sh->fd, F_GET_SEALS);
    if (seals >= 0 && !(seals & F_SEAL_WRITE) &&
        mmap(sh->map, sh->rec_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, sh->fd, 0) !=
            MAP_FAILED) {
        sh->state = SH_OPEN;
        return;
    }
    sh->state = SH_SEALED;
}

static int shared_commit(ts_client_t *c, uint8_t op, const char *bin, ts_shared_t *sh,
                         uint64_t *version)
{
    int rc = check_blocking(c);
    if (rc != 0)
        return rc;
    if (bin == NULL || sh == NULL)
        return ts__fail(TS_EINVAL, "bin and the shared buffer are required");
    if (sh->state == SH_DONE)
        return ts__fail(TS_EINVAL, "the shared buffer was committed already");
    size_t name_len = strlen(bin);
    if (name_len > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "bin name of %zu bytes (at most %d)", name_len,
                        TS_MAX_NAME_LEN);
    uint8_t copy_op = op == TS_OP_PUT_FD ? TS_OP_PUT : TS_OP_APPEND;
    int copy = c->unix_path == NULL;
    if (!copy) {
        uint64_t deadline = call_deadline(c);
        rc = lane_enter(c);
        if (rc != 0)
            return rc;
        rc = lane_ensure(c, deadline);
        if (rc == 1) {
            copy = 1;
        } else if (rc == 0) {
            uint8_t body[TS_MAX_CTRL_BODY];
            size_t len;
            ts__msg_put_fd_req m = {
                .name = (const uint8_t *)bin, .name_len = name_len, .rec_len = sh->rec_len};
            rc = ts__msg_put_fd_req_encode(body, sizeof(body), &m, &len);
            int was_open = sh->state == SH_OPEN;
            if (rc == 0 && was_open) {
                rc = shared_withdraw(sh);
                if (rc != 0)
                    ts__fail(rc, "cannot withdraw the shared buffer's mapping: %s",
                             strerror(errno));
            }
            lane_reply rep;
            if (rc == 0) {
                rc = lane_call(c, op, body, len, sh->fd, TS_BIN_STATE_SIZE, deadline, &rep);
                if (rc != 0 && ts_last_error()[0] == '\0')
                    ts__fail(rc, "%s on the descriptor lane: %s", op_name(op), ts_strerror(rc));
            }
            if (rc == 0 && rep.h.status != TS_ST_OK) {
                rc = reply_error(c, op, &rep);
            } else if (rc == 0) {
                ts__msg_bin_state st;
                if (ts__msg_bin_state_decode(rep.body, rep.len, &st) != 0) {
                    /* The server stored the item, but its answer broke the protocol. */
                    lane_close(c);
                    rc = ts__fail(TS_EPROTO, "%s: malformed reply", op_name(op));
                } else if (version != NULL) {
                    *version = st.version;
                }
                reply_clear(&rep); /* and the descriptors it does not claim (all of them) */
                if (rc == 0) {
                    sh->state = SH_DONE;
                    close(sh->fd);
                    sh->fd = -1;
                }
            }
            if (rc != 0 && sh->state != SH_DONE && was_open)
                shared_restore(sh);
        }
        lane_leave(c);
        if (!copy)
            return rc;
    }
    /* No descriptors: send the record through the main connection, then withdraw as above. */
    if (sh->state != SH_OPEN) {
        /* Sealed by a server that no longer takes descriptors: read it through a private copy. */
        void *p = mmap(NULL, sh->rec_len, PROT_READ, MAP_PRIVATE, sh->fd, 0);
        if (p == MAP_FAILED)
            return ts__fail(TS_ENOMEM, "cannot map the shared buffer: %s", strerror(errno));
        ts__rbuf *buf = ts__rbuf_new(p, sh->rec_len, unmap_fn);
        ts_value_t *v =
            buf == NULL ? NULL : ts__record_decode(buf, 0, sh->rec_len, TS_MAX_DEPTH, TS_MAX_NDIM);
        if (buf == NULL)
            munmap(p, sh->rec_len);
        ts__rbuf_unref(buf);
        if (v == NULL)
            return ts__fail(TS_ENOMEM, NULL);
        rc = copy_op == TS_OP_PUT ? ts_put(c, bin, v, version) : ts_append(c, bin, v, version);
        ts__record_tree_free(v);
    } else {
        rc = copy_op == TS_OP_PUT ? ts_put(c, bin, sh->root, version)
                                  : ts_append(c, bin, sh->root, version);
    }
    if (rc == 0) {
        if (sh->state == SH_OPEN)
            (void)shared_withdraw(sh); /* on failure the mapping stays: nothing is lost */
        sh->state = SH_DONE;
        close(sh->fd);
        sh->fd = -1;
    }
    return rc;
}

int ts_shared_put(ts_client_t *c, const char *bin, ts_shared_t *sh, uint64_t *version)
{
    c = ts__route(c, bin);
    return shared_commit(c, TS_OP_PUT_FD, bin, sh, version);
}

int ts_shared_append(ts_client_t *c, const char *bin, ts_shared_t *sh, uint64_t *version)
{
    c = ts__route(c, bin);
    return shared_commit(c, TS_OP_APPEND_FD, bin, sh, version);
}

void ts_shared_free(ts_shared_t *sh)
{
    if (sh == NULL)
        return;
    ts__record_tree_free(sh->root); /* unmaps the range (writable or reserved) */
    if (sh->fd >= 0)
        close(sh->fd);
    ts__free(sh);
}
