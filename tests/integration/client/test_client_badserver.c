/*
 * libtensorshare against a server that breaks the protocol. A fake server thread answers HELLO
 * correctly, then answers one request with a malformed frame (bad header, wrong opcode, lengths
 * that point past the body, broken records, truncated lists, bad lz4, a broken notification).
 * Each time the client must fail the request with TS_EPROTO (once, never crash or hang), drop
 * the connection, reconnect on its own and work again on the next connection. Correct answers
 * that arrive late, in pieces or behind a stray frame must still reach the right caller.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/socket.h>
#include <unistd.h>

#include "harness.h"
#include "record.h"
#include "test_client_util.h"

/* How the fake server answers the next request other than HELLO. */
enum {
    M_GOOD = 0,     /* a correct answer */
    M_BAD_MAGIC,    /* a header with the request magic */
    M_RESERVED,     /* a header with a reserved field set */
    M_HUGE_BODY,    /* a header announcing 2^50 body bytes */
    M_WRONG_OP,     /* a well-formed frame with another opcode */
    M_SHORT_STATE,  /* a bin state of 8 bytes instead of 16 */
    M_ITEMS_COUNT,  /* ITEMS announcing 2^32-1 items in 64 bytes */
    M_ITEMS_LEN,    /* ITEMS whose one item is 2^62 bytes long */
    M_ITEMS_RECORD, /* ITEMS whose one item is not a record */
    M_LIST_SHORT,   /* LIST announcing two entries, carrying one */
    M_LIST_NAME,    /* LIST whose name runs past the body */
    M_STATS_BAD,    /* STATS that is not a record */
    M_LZ4_BAD,      /* an lz4-flagged body that does not decompress */
    M_NOTIFY_BAD,   /* a truncated notification, then a correct answer */
    M_NOTIFY_EVENT, /* notifications with events the protocol lacks, a PUT one, a correct answer */
    M_LONG_ERROR,   /* NOT_FOUND with a 5000-byte message: above the protocol's 1024 bytes */
    M_HELLO_BAD,    /* HELLO answered with another protocol version */
    /* Correct answers delivered awkwardly (a blocking caller may be reading them itself): */
    M_STRAY_FIRST, /* first an answer to a request id never used, then the right one */
    M_SPLIT,       /* the answer in three pieces, 30 ms apart */
    M_LATE,        /* the answer 400 ms late */
    M_SLOW_BODY,   /* the header, then the body 600 ms later */
    /* Reply shapes every opcode is checked with (see test_reply_shapes): */
    M_EMPTY,     /* OK with an empty body */
    M_CUT,       /* OK with the correct body less its last byte */
    M_TRAILING,  /* OK with the correct body and 8 bytes more */
    M_ERR_EMPTY, /* NOT_FOUND without a message */
    M_ERR_MSG,   /* NOT_FOUND with a message */
    M_HUGE_OK,   /* OK announcing a 4 GiB body, none of which follows */
    M_BIG_OK,    /* OK announcing BIG_OK_LEN (PING: BIG_OK_PING_LEN), none of which follows */
    M_CLOSING    /* a connection-level SLOW_READER frame with a message, then the server closes */
};

/* bytes; the clients' max_reply_bytes: M_HUGE_OK's 4 GiB are far above it */
#define MAX_REPLY ((uint64_t)1 << 20)

/*
 * bytes; M_BIG_OK's announcements: above what a bin-state reply (16 bytes) or a PING reply
 * (empty) can hold, below MAX_REPLY, so that only the per-opcode header check
 * (ts__msg_reply_limit) can refuse them before the request's deadline.
 */
#define BIG_OK_LEN      ((uint64_t)64 << 10)
#define BIG_OK_PING_LEN ((uint64_t)1 << 10)

/*
 * The bit the client sets in the request id of a frame a blocking caller wrote itself
 * (TS__DIRECT_ID in client/internal.h). Only such a request can have its reply read by the
 * caller; whether the caller or the I/O thread then read it is not visible from here.
 */
#define DIRECT_ID_BIT 0x80000000u

/* The message of M_ERR_MSG and M_CLOSING. */
#define ERR_TEXT   "no bin here"
#define CLOSE_TEXT "you read too slowly (test)"

typedef struct fake {
    int lfd;
    int port;
    char addr[64];
    pthread_t thread;
    atomic_int stop;
    atomic_int mode;               /* for the next request; the server resets it to M_GOOD */
    atomic_int accepts;            /* connections accepted */
    atomic_int client_closed;      /* connections the client closed */
    atomic_int answered;           /* requests answered (HELLO excluded) */
    atomic_int direct;             /* of those, requests with DIRECT_ID_BIT in their id */
    _Atomic uint64_t refuse_until; /* tc_now_ms() before which HELLO gets TOO_MANY_CLIENTS */
} fake;

/* The message of a refused HELLO. */
#define REFUSE_TEXT "too many clients (test)"

static int send_frame(int fd, uint8_t op, uint16_t status, uint32_t rid, uint8_t flags,
                      const void *body, size_t len)
{
    uint8_t h[TS_HDR_SIZE];
    ts__hdr hdr = {.magic = TS_MAGIC_REP,
                   .version = TS_PROTO_VERSION,
                   .opcode = op,
                   .flags = flags,
                   .status = status,
                   .request_id = rid,
                   .body_len = len};
    ts__hdr_encode(&hdr, h);
    if (tsh_write_all(fd, h, sizeof(h)) != 0)
        return -1;
    return len > 0 ? tsh_write_all(fd, body, len) : 0;
}

/*
 * The correct OK body of a reply to op, in b (at least 64 bytes); returns its length. STATS
 * needs more room: *rec is then set to an aligned allocation holding the body (free it with
 * ts__free_aligned(*rec, len)).
 */
static size_t good_body(uint8_t op, uint8_t *b, uint8_t **rec)
{
    *rec = NULL;
    memset(b, 0, 64);
    switch (op) {
    case TS_OP_GET:
    case TS_OP_PEEK: /* no items: version 1, the 64-byte padded head */
        ts__put_u64le(b, 1);
        return 64;
    case TS_OP_PUT:
    case TS_OP_APPEND:
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_WAIT:
        ts__put_u64le(b, 1);
        return TS_BIN_STATE_SIZE;
    case TS_OP_LIST: /* no bins */
        return 8;
    case TS_OP_STATS: { /* {"bins": 0} */
        ts_value_t *m = ts_map_new();
        size_t len = 0;
        if (ts_map_set(m, "bins", ts_int_new(0)) != 0 || ts__record_encode(m, rec, &len) != 0)
            len = 0;
        ts_value_free(m);
        return len;
    }
    default:
        return 0;
    }
}

/* A correct answer to a request with opcode op. */
static void answer_good(int fd, uint8_t op, uint32_t rid)
{
    uint8_t b[64];
    uint8_t *rec;
    size_t len = good_body(op, b, &rec);
    send_frame(fd, op, TS_ST_OK, rid, 0, rec != NULL ? rec : b, len);
    ts__free_aligned(rec, len);
}

/* The correct body changed by mode (M_EMPTY, M_CUT, M_TRAILING). */
static void answer_shape(int fd, int mode, uint8_t op, uint32_t rid)
{
    uint8_t b[64];
    uint8_t *rec;
    size_t len = good_body(op, b, &rec);
    uint8_t *out = malloc(len + 8);
    if (out == NULL)
        abort();
    memcpy(out, rec != NULL ? rec : b, len);
    memset(out + len, 0, 8);
    size_t n = mode == M_EMPTY ? 0 : mode == M_CUT ? (len > 0 ? len - 1 : 0) : len + 8;
    send_frame(fd, op, TS_ST_OK, rid, 0, out, n);
    free(out);
    ts__free_aligned(rec, len);
}

/* A notification for bin "b" with the given body length cut and event. */
static void send_notify(int fd, size_t cut, uint8_t event)
{
    uint8_t b[32];
    memset(b, 0, sizeof(b));
    ts__put_u64le(b, 2);
    ts__put_u32le(b + 8, 1);
    b[12] = event;
    b[14] = 1;
    b[15] = 'b';
    send_frame(fd, TS_OP_NOTIFY, TS_ST_OK, 0, 0, b, 16 - cut);
}

static void answer_bad(int fd, int mode, uint8_t op, uint32_t rid)
{
    uint8_t b[256];
    uint8_t h[TS_HDR_SIZE];
    memset(b, 0, sizeof(b));
    ts__hdr hdr = {
        .magic = TS_MAGIC_REP, .version = TS_PROTO_VERSION, .opcode = op, .request_id = rid};
    switch (mode) {
    case M_BAD_MAGIC:
    case M_RESERVED:
    case M_HUGE_BODY:
        hdr.body_len = mode == M_HUGE_BODY ? (uint64_t)1 << 50 : 0;
        ts__hdr_encode(&hdr, h);
        if (mode == M_BAD_MAGIC)
            h[0] = TS_MAGIC_REQ;
        if (mode == M_RESERVED)
            h[13] = 1;
        tsh_write_all(fd, h, sizeof(h));
        break;
    case M_WRONG_OP:
        send_frame(fd, op == TS_OP_GET ? TS_OP_PEEK : TS_OP_GET, TS_ST_OK, rid, 0, NULL, 0);
        break;
    case M_SHORT_STATE:
        send_frame(fd, op, TS_ST_OK, rid, 0, b, 8);
        break;
    case M_ITEMS_COUNT:
        ts__put_u32le(b + 8, UINT32_MAX);
        send_frame(fd, op, TS_ST_OK, rid, 0, b, 64);
        break;
    case M_ITEMS_LEN:
    case M_ITEMS_RECORD:
        ts__put_u32le(b + 8, 1);
        ts__put_u64le(b + 16, mode == M_ITEMS_LEN ? (uint64_t)1 << 62 : 64);
        memset(b + 64, 0xA5, 64); /* not a record */
        send_frame(fd, op, TS_ST_OK, rid, 0, b, 128);
        break;
    case M_LIST_SHORT:
    case M_LIST_NAME:
        ts__put_u32le(b, mode == M_LIST_SHORT ? 2 : 1);
        b[8] = mode == M_LIST_SHORT ? 1 : 200; /* the name's length */
        b[9] = 'x';
        b[30] = 5; /* M_LIST_SHORT: a second entry whose name needs 5 + 20 of 21 bytes */
        send_frame(fd, op, TS_ST_OK, rid, 0, b, mode == M_LIST_SHORT ? 8 + 22 + 21 : 8 + 22 + 20);
        break;
    case M_STATS_BAD:
        memset(b, 0x5A, 32);
        send_frame(fd, op, TS_ST_OK, rid, 0, b, 32);
        break;
    case M_LZ4_BAD:
        ts__put_u64le(b, 100); /* 100 raw bytes announced, then junk for the block */
        memset(b + 8, 0xFF, 24);
        send_frame(fd, op, TS_ST_OK, rid, TS_FLAG_LZ4, b, 32);
        break;
    case M_NOTIFY_BAD:
    case M_NOTIFY_EVENT:
        if (mode == M_NOTIFY_BAD) {
            send_notify(fd, 3, TS_NOTE_PUT);
        } else {
            /* Unknown to the client (0, inside and past the server's range): all ignored. */
            static const uint8_t unknown[] = {0,  7, 99, TS_EV_DISCONNECTED, TS_EV_RESUBSCRIBED,
                                              255};
            for (size_t i = 0; i < sizeof(unknown); i++)
                send_notify(fd, 0, unknown[i]);
            send_notify(fd, 0, TS_NOTE_PUT);
        }
        answer_good(fd, op, rid);
        break;
    case M_STRAY_FIRST:
        answer_good(fd, op, rid ^ 0x5A5A5A5Au);
        answer_good(fd, op, rid);
        break;
    case M_SPLIT:
    case M_SLOW_BODY: {
        /* A PUT's answer: the header, then the bin state in two pieces. */
        ts__put_u64le(b, 1);
        hdr.body_len = TS_BIN_STATE_SIZE;
        ts__hdr_encode(&hdr, h);
        tsh_write_all(fd, h, sizeof(h));
        tc_sleep_ms(mode == M_SPLIT ? 30 : 600);
        tsh_write_all(fd, b, 5);
        tc_sleep_ms(mode == M_SPLIT ? 30 : 0);
        tsh_write_all(fd, b + 5, TS_BIN_STATE_SIZE - 5);
        break;
    }
    case M_LATE:
        tc_sleep_ms(400);
        answer_good(fd, op, rid);
        break;
    case M_EMPTY:
    case M_CUT:
    case M_TRAILING:
        answer_shape(fd, mode, op, rid);
        break;
    case M_ERR_EMPTY:
        send_frame(fd, op, TS_ST_NOT_FOUND, rid, 0, NULL, 0);
        break;
    case M_ERR_MSG:
        send_frame(fd, op, TS_ST_NOT_FOUND, rid, 0, ERR_TEXT, strlen(ERR_TEXT));
        break;
    case M_HUGE_OK:
        hdr.body_len = (uint64_t)4 << 30;
        ts__hdr_encode(&hdr, h);
        tsh_write_all(fd, h, sizeof(h));
        break;
    case M_BIG_OK:
        hdr.body_len = op == TS_OP_PING ? BIG_OK_PING_LEN : BIG_OK_LEN;
        ts__hdr_encode(&hdr, h);
        tsh_write_all(fd, h, sizeof(h));
        break;
    case M_CLOSING:
        send_frame(fd, 0, TS_ST_SLOW_READER, 0, 0, CLOSE_TEXT, strlen(CLOSE_TEXT));
        break;
    default: /* M_LONG_ERROR */ {
        char msg[5000];
        memset(msg, 'e', sizeof(msg));
        send_frame(fd, op, TS_ST_NOT_FOUND, rid, 0, msg, sizeof(msg));
        break;
    }
    }
}

/* Read one request from fd and answer it. 0, or -1 when the client closed the connection. */
static int serve_one(fake *f, int fd)
{
    uint8_t h[TS_HDR_SIZE];
    if (tsh_read_all(fd, h, sizeof(h)) != 0)
        return -1;
    ts__hdr hdr;
    if (ts__hdr_decode(h, TS_MAGIC_REQ, &hdr) != 0 || hdr.body_len > (1u << 20))
        return -1;
    uint8_t *body = malloc(hdr.body_len > 0 ? (size_t)hdr.body_len : 1);
    if (body == NULL || (hdr.body_len > 0 && tsh_read_all(fd, body, (size_t)hdr.body_len) != 0)) {
        free(body);
        return -1;
    }
    free(body);
    int mode = atomic_load(&f->mode);
    if (hdr.opcode == TS_OP_HELLO && tc_now_ms() < atomic_load(&f->refuse_until)) {
        send_frame(fd, TS_OP_HELLO, TS_ST_TOO_MANY_CLIENTS, hdr.request_id, 0, REFUSE_TEXT,
                   strlen(REFUSE_TEXT));
        return -1;
    }
    if (hdr.opcode == TS_OP_HELLO) {
        uint8_t b[24];
        memset(b, 0, sizeof(b));
        b[0] = mode == M_HELLO_BAD ? 9 : TS_PROTO_VERSION;
        ts__put_u64le(b + 8, (uint64_t)1 << 20);
        send_frame(fd, TS_OP_HELLO, TS_ST_OK, hdr.request_id, 0, b, sizeof(b));
        if (mode == M_HELLO_BAD)
            atomic_store(&f->mode, M_GOOD);
        return 0;
    }
    atomic_store(&f->mode, M_GOOD);
    if (hdr.request_id & DIRECT_ID_BIT)
        atomic_fetch_add(&f->direct, 1);
    if (mode == M_GOOD || mode == M_HELLO_BAD)
        answer_good(fd, hdr.opcode, hdr.request_id);
    else
        answer_bad(fd, mode, hdr.opcode, hdr.request_id);
    atomic_fetch_add(&f->answered, 1);
    return mode == M_CLOSING ? -1 : 0; /* M_CLOSING: the server ends the connection */
}

/* The server thread: one connection at a time (the client holds one). */
static void *fake_main(void *arg)
{
    fake *f = arg;
    int cfd = -1;
    while (!atomic_load(&f->stop)) {
        struct pollfd p[2] = {{.fd = f->lfd, .events = POLLIN}, {.fd = cfd, .events = POLLIN}};
        if (poll(p, cfd >= 0 ? 2 : 1, 50) <= 0)
            continue;
        /* The old connection first, so that its end is counted before a reconnection. */
        if (cfd >= 0 && (p[1].revents & (POLLIN | POLLHUP | POLLERR))) {
            if (serve_one(f, cfd) != 0) {
                close(cfd);
                cfd = -1;
                atomic_fetch_add(&f->client_closed, 1);
            }
        }
        if (p[0].revents & POLLIN) {
            int fd = accept(f->lfd, NULL, NULL);
            if (fd >= 0) {
                if (cfd >= 0)
                    close(cfd);
                struct timeval tv = {5, 0};
                setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
                setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
                cfd = fd;
                atomic_fetch_add(&f->accepts, 1);
            }
        }
    }
    if (cfd >= 0)
        close(cfd);
    return NULL;
}

static void fake_start(fake *f, int mode)
{
    memset(f, 0, sizeof(*f));
    atomic_init(&f->mode, mode);
    atomic_init(&f->refuse_until, 0);
    f->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(f->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    assert_int_equal(bind(f->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(f->lfd, 8), 0);
    assert_int_equal(getsockname(f->lfd, (struct sockaddr *)&a, &len), 0);
    f->port = ntohs(a.sin_port);
    snprintf(f->addr, sizeof(f->addr), "127.0.0.1:%d", f->port);
    assert_int_equal(pthread_create(&f->thread, NULL, fake_main, f), 0);
}

static void fake_stop(fake *f)
{
    atomic_store(&f->stop, 1);
    pthread_join(f->thread, NULL);
    close(f->lfd);
}

/* Wait (bounded) until *v reaches target; returns its value. */
static int wait_for(atomic_int *v, int target)
{
    uint64_t until = tc_now_ms() + TC_WAIT_MS;
    while (atomic_load(v) < target && tc_now_ms() < until)
        tc_sleep_ms(5);
    return atomic_load(v);
}

/*
 * Which read path a test runs on: the state of every test is one of these, and the test sets
 * TS_CLIENT_DIRECT before it opens its clients (no other client lives then, so no I/O thread
 * reads the environment meanwhile).
 */
static int path_caller = 1; /* a blocking caller may read its own reply (the default) */
static int path_io = 0;     /* TS_CLIENT_DIRECT=0: the I/O thread reads every reply */

static void use_path(void **state)
{
    int caller = *(int *)*state;
    setenv("TS_CLIENT_DIRECT", caller ? "1" : "0", 1);
    printf("read path: %s\n", caller ? "caller" : "I/O thread");
}

static ts_client_t *open_client(fake *f)
{
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 5000;
    o.request_timeout_ms = 10000;
    o.reconnect_min_ms = 10;
    o.reconnect_max_ms = 50;
    o.max_reply_bytes = MAX_REPLY;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, f->addr, &o), 0);
    return c;
}

/* Issue the request a mode is aimed at; returns its status. */
static int do_op(ts_client_t *c, uint8_t op)
{
    ts_items_t *items = NULL;
    ts_bin_list_t *bins = NULL;
    ts_value_t *stats = NULL;
    int rc;
    switch (op) {
    case TS_OP_GET:
        rc = ts_get(c, "b", 0, &items);
        break;
    case TS_OP_PEEK:
        rc = ts_peek(c, "b", 0, &items);
        break;
    case TS_OP_WAIT:
        rc = ts_wait(c, "b", 0, 1000, NULL, NULL);
        break;
    case TS_OP_DELETE:
        rc = ts_delete(c, "b", NULL);
        break;
    case TS_OP_LIST:
        rc = ts_list(c, &bins);
        break;
    case TS_OP_STATS:
        rc = ts_stats(c, &stats);
        break;
    case TS_OP_PUT: {
        ts_value_t *v = tc_item(1, 0, 0);
        rc = ts_put(c, "b", v, NULL);
        ts_value_free(v);
        break;
    }
    default:
        rc = ts_ping(c);
        break;
    }
    /* Out-parameters are written only on success. */
    if (rc != 0) {
        assert_null(items);
        assert_null(bins);
        assert_null(stats);
    }
    ts_items_free(items);
    ts_bin_list_free(bins);
    ts_value_free(stats);
    return rc;
}

/* One malformed answer: TS_EPROTO, the client drops the connection, reconnects and works. */
static void check_bad(fake *f, ts_client_t *c, int mode, uint8_t op)
{
    int accepts = atomic_load(&f->accepts);
    int closed = atomic_load(&f->client_closed);
    atomic_store(&f->mode, mode);
    int rc = do_op(c, op);
    printf("mode %d (opcode %d): %s\n", mode, op, ts_err_name(rc));
    assert_int_equal(rc, TS_EPROTO);
    assert_int_equal(wait_for(&f->client_closed, closed + 1), closed + 1);
    /* The next call waits for the reconnection on its own. */
    assert_int_equal(do_op(c, op), 0);
    assert_int_equal(atomic_load(&f->accepts), accepts + 1);
    assert_int_equal(ts_client_connected(c), 1);
}

static void test_malformed_replies(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_t *c = open_client(&f);
    assert_int_equal(do_op(c, TS_OP_PING), 0);

    check_bad(&f, c, M_BAD_MAGIC, TS_OP_PING);
    check_bad(&f, c, M_RESERVED, TS_OP_PING);
    check_bad(&f, c, M_HUGE_BODY, TS_OP_PING);
    check_bad(&f, c, M_WRONG_OP, TS_OP_GET);
    check_bad(&f, c, M_SHORT_STATE, TS_OP_DELETE);
    check_bad(&f, c, M_ITEMS_COUNT, TS_OP_GET);
    check_bad(&f, c, M_ITEMS_LEN, TS_OP_GET);
    check_bad(&f, c, M_ITEMS_RECORD, TS_OP_GET);
    check_bad(&f, c, M_LIST_SHORT, TS_OP_LIST);
    check_bad(&f, c, M_LIST_NAME, TS_OP_LIST);
    check_bad(&f, c, M_STATS_BAD, TS_OP_STATS);
    check_bad(&f, c, M_LZ4_BAD, TS_OP_PING);
    check_bad(&f, c, M_NOTIFY_BAD, TS_OP_PING);

    /* An error message longer than the protocol allows (1024 bytes) is malformed too. */
    check_bad(&f, c, M_LONG_ERROR, TS_OP_PING);

    ts_client_free(c);
    fake_stop(&f);
}

/* Counts the notifications a subscription gets, and remembers the last event. */
typedef struct notes {
    atomic_int n;
    atomic_int last_event;
} notes;

static void note_cb(ts_client_t *c, int status, const ts_notification_t *n, void *arg)
{
    notes *k = arg;
    (void)c;
    if (status != 0 || n == NULL)
        return;
    atomic_store(&k->last_event, (int)n->event);
    atomic_fetch_add(&k->n, 1);
}

/*
 * PROTOCOL.md 8.14: a client ignores a NOTIFY event it does not know. Notifications with
 * unknown events for a bin it listens to reach no callback and cost no connection; the known
 * one that follows them is delivered, and the call answered after them succeeds.
 */
static void test_unknown_notify_event(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_t *c = open_client(&f);
    notes k;
    atomic_init(&k.n, 0);
    atomic_init(&k.last_event, 0);
    assert_int_equal(ts_listen(c, "b", note_cb, &k), 0);
    int accepts = atomic_load(&f.accepts);
    int closed = atomic_load(&f.client_closed);
    atomic_store(&f.mode, M_NOTIFY_EVENT);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    assert_int_equal(wait_for(&k.n, 1), 1);
    assert_int_equal(atomic_load(&k.last_event), TS_EV_PUT);
    /* Still the same connection, and still working. */
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    assert_int_equal(atomic_load(&f.accepts), accepts);
    assert_int_equal(atomic_load(&f.client_closed), closed);
    assert_int_equal(atomic_load(&k.n), 1);
    assert_int_equal(ts_unlisten(c, "b"), 0);
    ts_client_free(c);
    fake_stop(&f);
}

/*
 * Every reply shape for every opcode a blocking call may send: the malformed ones fail the call
 * with TS_EPROTO and cost the connection; error replies fail it with their status and message
 * and keep the connection; a server's connection-level error reaches the call with its status
 * and message. The caller-side and the I/O thread's read path must agree on each.
 */
static void test_reply_shapes(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_t *c = open_client(&f);
    static const uint8_t ops[] = {TS_OP_PING,   TS_OP_GET,  TS_OP_PEEK,  TS_OP_PUT,
                                  TS_OP_DELETE, TS_OP_LIST, TS_OP_STATS, TS_OP_WAIT};
    static const int modes[] = {M_EMPTY,   M_CUT,     M_TRAILING, M_ERR_EMPTY,
                                M_ERR_MSG, M_HUGE_OK, M_BIG_OK,   M_CLOSING};
    int caller = *(int *)*state;
    for (size_t i = 0; i < sizeof(ops); i++) {
        for (size_t j = 0; j < sizeof(modes) / sizeof(modes[0]); j++) {
            uint8_t op = ops[i];
            int mode = modes[j];
            if (mode == M_CUT && op == TS_OP_PING)
                continue; /* nothing to cut */
            /*
             * Replies of variable length (items, bins, a STATS record) may be as long as
             * MAX_REPLY: M_BIG_OK's announcement is legal for them, and the call would wait
             * for the body until its deadline.
             */
            if (mode == M_BIG_OK && op != TS_OP_PING && op != TS_OP_PUT && op != TS_OP_DELETE &&
                op != TS_OP_WAIT)
                continue;
            /*
             * Two correct calls first, so that the caller-side path has the socket (on the
             * caller path; the fake server's direct count below checks what it can of that).
             */
            assert_int_equal(do_op(c, op), 0);
            assert_int_equal(do_op(c, op), 0);
            int accepts = atomic_load(&f.accepts);
            int closed = atomic_load(&f.client_closed);
            int direct = atomic_load(&f.direct);
            atomic_store(&f.mode, mode);
            uint64_t t0 = tc_now_ms();
            int rc = do_op(c, op);
            uint64_t took = tc_now_ms() - t0;
            const char *msg = ts_last_error();
            printf("opcode %d, mode %d: %s (%s) in %llu ms\n", op, mode, ts_err_name(rc), msg,
                   (unsigned long long)took);
            /* No shape waits for a deadline (the request timeout is 10 s). */
            assert_true(took < 5000);
            /*
             * The caller wrote this request itself on the caller path, never on the other:
             * the precondition of the caller reading its own reply (who really read it is
             * client-internal state this test does not see).
             */
            assert_int_equal(atomic_load(&f.direct) - direct, caller ? 1 : 0);
            /* An announcement above the opcode's limit fails at the header, not the deadline. */
            if (mode == M_BIG_OK)
                assert_true(took < 2000);
            if (mode == M_ERR_EMPTY || mode == M_ERR_MSG) {
                assert_int_equal(rc, TS_ENOENT);
                /* An error reply without a message leaves the code's own text. */
                assert_string_equal(msg, mode == M_ERR_MSG ? ERR_TEXT : ts_strerror(TS_ENOENT));
            } else if (mode == M_CLOSING) {
                assert_int_equal(rc, TS_ESLOW);
                assert_non_null(strstr(msg, CLOSE_TEXT));
                assert_int_equal(wait_for(&f.client_closed, closed + 1), closed + 1);
            } else if (mode == M_EMPTY && op == TS_OP_PING) {
                assert_int_equal(rc, 0);
            } else {
                assert_int_equal(rc, TS_EPROTO);
                assert_int_equal(wait_for(&f.client_closed, closed + 1), closed + 1);
                /* A reply over the client's own limit says so, not "malformed". */
                if (mode == M_HUGE_OK &&
                    (op == TS_OP_GET || op == TS_OP_PEEK || op == TS_OP_LIST || op == TS_OP_STATS))
                    assert_non_null(strstr(msg, "over the client's max_reply_bytes"));
            }
            /* The next call works, on the same connection unless this one had to go. */
            assert_int_equal(do_op(c, op), 0);
            int kept =
                mode == M_ERR_EMPTY || mode == M_ERR_MSG || (mode == M_EMPTY && op == TS_OP_PING);
            assert_int_equal(atomic_load(&f.accepts), accepts + (kept ? 0 : 1));
        }
    }
    ts_client_free(c);
    fake_stop(&f);
}

/*
 * The server closes the connection with its reason, then refuses the reconnections for a while:
 * a call waiting for the connection fails with the refusal's code and message rather than at
 * its deadline, and once the server takes the client again, calls work.
 */
static void test_refused_reconnect(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_t *c = open_client(&f);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    atomic_store(&f.refuse_until, tc_now_ms() + 1000);
    atomic_store(&f.mode, M_CLOSING);
    assert_int_equal(do_op(c, TS_OP_PING), TS_ESLOW);
    assert_non_null(strstr(ts_last_error(), CLOSE_TEXT));
    uint64_t t0 = tc_now_ms();
    int rc = do_op(c, TS_OP_PING);
    printf("while refused: %s (%s) in %llu ms\n", ts_err_name(rc), ts_last_error(),
           (unsigned long long)(tc_now_ms() - t0));
    assert_int_equal(rc, TS_ETOOMANY);
    assert_non_null(strstr(ts_last_error(), REFUSE_TEXT));
    assert_null(strstr(ts_last_error(), "too many clients: too many clients"));
    tc_sleep_ms(1100);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    ts_client_free(c);
    fake_stop(&f);
}

/* Counts callbacks of pipelined requests. */
typedef struct cb_count {
    tc_latch done;
    atomic_int eproto;
    atomic_int other;
} cb_count;

static void count_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    cb_count *cc = arg;
    if (status == TS_EPROTO)
        atomic_fetch_add(&cc->eproto, 1);
    else if (status != 0)
        atomic_fetch_add(&cc->other, 1);
    tc_latch_add(&cc->done, 1);
}

/* Pipelined requests around a malformed answer: every callback once, none lost, none twice. */
static void test_malformed_pipelined(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_t *c = open_client(&f);
    cb_count cc;
    tc_latch_init(&cc.done);
    atomic_init(&cc.eproto, 0);
    atomic_init(&cc.other, 0);
    enum { N = 32 };
    atomic_store(&f.mode, M_ITEMS_RECORD);
    for (int i = 0; i < N; i++)
        assert_int_equal(ts_get_async(c, "b", 0, count_cb, &cc), 0);
    assert_int_equal(tc_latch_wait(&cc.done, N, TC_WAIT_MS), N);
    /* The broken answer fails its request with TS_EPROTO and so do the ones still in flight. */
    printf("%d of %d pipelined requests failed with EPROTO, %d otherwise\n",
           atomic_load(&cc.eproto), N, atomic_load(&cc.other));
    assert_true(atomic_load(&cc.eproto) >= 1);
    assert_int_equal(atomic_load(&cc.other), 0);
    assert_int_equal(do_op(c, TS_OP_GET), 0);
    tc_sleep_ms(100); /* a late duplicate callback would show up here */
    assert_int_equal(tc_latch_get(&cc.done), N);
    ts_client_free(c);
    tc_latch_destroy(&cc.done);
    fake_stop(&f);
}

/*
 * Correct answers that arrive awkwardly. An idle client lets a blocking caller read its own
 * answer; a stray frame first, an answer in pieces, one past the deadline or one cut by the
 * deadline must each end as they would on the client's I/O thread.
 */
static void test_awkward_answers(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_GOOD);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 250;
    o.reconnect_min_ms = 10;
    o.reconnect_max_ms = 50;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, f.addr, &o), 0);
    for (int i = 0; i < 20; i++)
        assert_int_equal(do_op(c, i % 2 ? TS_OP_PUT : TS_OP_GET), 0);
    int accepts = atomic_load(&f.accepts);

    /* The stray answer is dropped; the caller gets its own. */
    atomic_store(&f.mode, M_STRAY_FIRST);
    assert_int_equal(do_op(c, TS_OP_PUT), 0);
    assert_int_equal(do_op(c, TS_OP_GET), 0);
    /* An answer in pieces is put together. */
    atomic_store(&f.mode, M_SPLIT);
    assert_int_equal(do_op(c, TS_OP_PUT), 0);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    assert_int_equal(atomic_load(&f.accepts), accepts);

    /* Past the deadline: TS_ETIMEDOUT; the late answer is dropped when it comes. */
    atomic_store(&f.mode, M_LATE);
    uint64_t t0 = tc_now_ms();
    assert_int_equal(do_op(c, TS_OP_PUT), TS_ETIMEDOUT);
    assert_true(tc_now_ms() - t0 < 2000);
    tc_sleep_ms(300);
    assert_int_equal(do_op(c, TS_OP_GET), 0);
    assert_int_equal(do_op(c, TS_OP_PUT), 0);
    assert_int_equal(atomic_load(&f.accepts), accepts);

    /*
     * Cut by the deadline in the middle of the answer: TS_ETIMEDOUT. Part of a frame may have
     * been consumed, so the connection may have to go; the next calls work either way.
     */
    atomic_store(&f.mode, M_SLOW_BODY);
    assert_int_equal(do_op(c, TS_OP_PUT), TS_ETIMEDOUT);
    tc_sleep_ms(700);
    assert_int_equal(do_op(c, TS_OP_PUT), 0);
    assert_int_equal(do_op(c, TS_OP_GET), 0);
    printf("connections after a cut answer: %d\n", atomic_load(&f.accepts) - accepts + 1);
    ts_client_free(c);
    fake_stop(&f);
}

/*
 * A server that answers HELLO, then reads nothing (until stop is set); its listening socket and
 * address are set up by mute_start.
 */
typedef struct mute {
    int lfd;
    char addr[64];
    pthread_t thread;
    atomic_int stop;
} mute;

static void *mute_main(void *arg)
{
    mute *m = arg;
    int fd = accept(m->lfd, NULL, NULL);
    if (fd < 0)
        return NULL;
    uint8_t h[TS_HDR_SIZE];
    ts__hdr hdr;
    if (tsh_read_all(fd, h, sizeof(h)) == 0 && ts__hdr_decode(h, TS_MAGIC_REQ, &hdr) == 0 &&
        hdr.body_len <= 4096) {
        uint8_t body[4096];
        if (tsh_read_all(fd, body, (size_t)hdr.body_len) == 0) {
            uint8_t b[24];
            memset(b, 0, sizeof(b));
            b[0] = TS_PROTO_VERSION;
            ts__put_u64le(b + 8, (uint64_t)1 << 30);
            send_frame(fd, TS_OP_HELLO, TS_ST_OK, hdr.request_id, 0, b, sizeof(b));
        }
    }
    uint64_t until = tc_now_ms() + 20000;
    while (!atomic_load(&m->stop) && tc_now_ms() < until)
        tc_sleep_ms(10);
    close(fd);
    return NULL;
}

static void mute_start(mute *m)
{
    memset(m, 0, sizeof(*m));
    m->lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(m->lfd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(a);
    assert_int_equal(bind(m->lfd, (struct sockaddr *)&a, sizeof(a)), 0);
    assert_int_equal(listen(m->lfd, 1), 0);
    assert_int_equal(getsockname(m->lfd, (struct sockaddr *)&a, &len), 0);
    snprintf(m->addr, sizeof(m->addr), "127.0.0.1:%d", ntohs(a.sin_port));
    assert_int_equal(pthread_create(&m->thread, NULL, mute_main, m), 0);
}

static void mute_stop(mute *m)
{
    atomic_store(&m->stop, 1);
    pthread_join(m->thread, NULL);
    close(m->lfd);
}

/* A callback that holds the I/O thread up for a while. */
static void slow_cb(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)status;
    (void)res;
    (void)arg;
    tc_sleep_ms(2500);
}

typedef struct big_put {
    ts_client_t *c;
    int rc;
} big_put;

static void *big_put_main(void *arg)
{
    big_put *p = arg;
    int64_t shape[1] = {16 << 20}; /* 64 MiB: far more than the socket takes at once */
    ts_value_t *v = ts_tensor_alloc(TS_FLOAT32, 1, shape);
    p->rc = v != NULL ? ts_put(p->c, "big", v, NULL) : TS_ENOMEM;
    ts_value_free(v);
    return NULL;
}

/*
 * A blocking put whose frame the socket takes only in part, while a callback holds the I/O
 * thread up past the put's deadline: the caller gives up and waits for the write of its memory
 * to end. Closing the client then ends that write and the call, and nothing is freed under the
 * waiting caller.
 */
static void test_abandoned_put_then_free(void **state)
{
    use_path(state);
    mute m;
    mute_start(&m);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.request_timeout_ms = 200;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, m.addr, &o), 0);
    /* Never answered: its timeout runs slow_cb on the I/O thread at about 200 ms. */
    assert_int_equal(ts_ping_async(c, slow_cb, NULL), 0);
    tc_sleep_ms(300);
    big_put p = {c, 1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, big_put_main, &p), 0);
    tc_sleep_ms(1800); /* past the put's deadline and grace, while slow_cb still runs */
    uint64_t t0 = tc_now_ms();
    ts_client_free(c);
    pthread_join(th, NULL);
    printf("abandoned put: %s; ts_client_free took %llu ms\n", ts_err_name(p.rc),
           (unsigned long long)(tc_now_ms() - t0));
    mute_stop(&m);
    /* Given up (normally), or cancelled if a slow machine had not got there yet. */
    assert_true(p.rc == TS_ETIMEDOUT || p.rc == TS_ECANCELED);
}

/* A handshake with a malformed answer fails ts_client_open with TS_EPROTO. */
static void test_malformed_hello(void **state)
{
    use_path(state);
    fake f;
    fake_start(&f, M_HELLO_BAD);
    ts_client_options_t o;
    ts_client_options_init(&o);
    o.connect_timeout_ms = 5000;
    ts_client_t *c = NULL;
    assert_int_equal(ts_client_open(&c, f.addr, &o), TS_EPROTO);
    assert_null(c);
    printf("open: %s\n", ts_last_error());
    /* The server answers correctly from now on. */
    c = open_client(&f);
    assert_int_equal(do_op(c, TS_OP_PING), 0);
    ts_client_free(c);
    fake_stop(&f);
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* the fake server may write to a connection the client closed */
#define BOTH_PATHS(t)                                                                              \
    cmocka_unit_test_prestate(t, &path_caller), cmocka_unit_test_prestate(t, &path_io)
    const struct CMUnitTest tests[] = {
        BOTH_PATHS(test_reply_shapes),
        BOTH_PATHS(test_refused_reconnect),
        BOTH_PATHS(test_malformed_replies),
        BOTH_PATHS(test_unknown_notify_event),
        BOTH_PATHS(test_malformed_pipelined),
        BOTH_PATHS(test_malformed_hello),
        BOTH_PATHS(test_awkward_answers),
        cmocka_unit_test_prestate(test_abandoned_put_then_free, &path_caller),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
