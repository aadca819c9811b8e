/*
 * Writing requests (I/O thread): each request's frame is its header and fixed part, then a flat
 * buffer or the record plan's head and segments, written with one uv_write (writev); a burst of
 * requests from the inbox is gathered into one write. The write callbacks release the frames to
 * the completion.
 */
#include "internal.h"

#include "compress.h"
#include "msg.h"

#include <assert.h>
#include <stdio.h>

/* write buffers a write keeps on the stack; a frame or batch needing more allocates its array */
#define TS__LOCAL_BUFS 64

/* ---------------------------------------------------------------------------------------------
 * Writing
 */

/*
 * Every write the I/O thread starts is counted in io_writes (under mu) from before uv_write until
 * its callback, so that no blocking caller writes directly while libuv may still have a frame
 * half written (see "Direct writes" below). While the connection is ready, the I/O thread writes
 * only from async_cb, which finishes a pending handoff before anything else.
 */
void ts__io_write_begin(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    c->io_writes++;
    pthread_mutex_unlock(&c->mu);
}

void ts__io_write_end(ts_client_t *c)
{
    pthread_mutex_lock(&c->mu);
    c->io_writes--;
    pthread_mutex_unlock(&c->mu);
}

/* A request's frame has been written (or the write failed): release it to the completion. */
static void write_done(ts_client_t *c, ts__req *r)
{
    int finish = r->wstate == TS__W_FINISH_CB;
    r->wstate = TS__W_NONE;
    if (r->kind == TS__K_BLOCK) {
        pthread_mutex_lock(&c->mu);
        r->wbusy = 0;
        if (ts__req_abandoned_locked(r))
            pthread_cond_broadcast(&r->cond);
        pthread_mutex_unlock(&c->mu);
    }
    if (finish)
        ts__req_finish(c, r, r->status); /* r is gone after this */
}

void ts__write_cb(uv_write_t *w, int status)
{
    ts__req *r = w->data;
    ts_client_t *c = r->c;
    ts__conn *conn = r->conn;
    ts__io_write_end(c);
    write_done(c, r);
    if (status < 0 && conn == c->conn && conn != NULL)
        ts__conn_fail(c, conn, TS_ECONNRESET, "write to the server failed");
}

/* Undo lz4 for a connection that did not agree on it (a reconnect to another server). */
static int inflate_body(ts__req *r)
{
    uint64_t raw;
    if (ts__lz4_raw_len(r->flat, r->flat_len, &raw) != 0 || ts__lz4_bound(raw) == 0)
        return TS_EPROTO;
    uint8_t *out = ts__malloc_aligned(raw);
    if (out == NULL)
        return TS_ENOMEM;
    if (ts__lz4_decompress(r->flat, r->flat_len, out, raw) != 0) {
        ts__free_aligned(out, raw);
        return TS_EPROTO;
    }
    ts__free_aligned(r->flat, r->flat_cap);
    r->flat = out;
    r->flat_len = r->flat_cap = raw;
    r->body_len = r->small_len + raw;
    r->hflags &= (uint8_t)~TS_FLAG_LZ4;
    return 0;
}

int ts__req_body(ts__req *r, const ts__msg_name_req *m)
{
    const ts__msg_op *info = ts__msg_op_info(r->op);
    uint8_t *out = r->small + TS_HDR_SIZE;
    size_t cap = sizeof(r->small) - TS_HDR_SIZE;
    size_t len = 0;
    int rc;
    switch (info != NULL ? (ts__msg_kind)info->request : TS_MSG_NONE) {
    case TS_MSG_EMPTY:
        rc = 0;
        break;
    case TS_MSG_NAME_REQ:
        rc = ts__msg_name_req_encode(out, cap, m, &len);
        break;
    case TS_MSG_GET_REQ:
        rc = ts__msg_get_req_encode(out, cap, m, &len);
        break;
    case TS_MSG_WAIT_REQ:
        rc = ts__msg_wait_req_encode(out, cap, m, &len);
        break;
    case TS_MSG_PUT_REQ:
        /*
         * The head; the record follows from its own buffers. An opcode with fixed fields after
         * the name gets them as zeros here, and its caller writes them (ts__req_upload_fixed).
         */
        rc = ts__msg_upload_head_encode(out, cap, m->name, m->name_len, NULL, info->upload_fixed,
                                        &len);
        break;
    default: /* HELLO has its own body (see conn.c); nothing else is a request */
        rc = TS_EINVAL;
        break;
    }
    if (rc != 0)
        return rc;
    r->small_len = len;
    r->body_len = len;
    return 0;
}

uint8_t *ts__req_upload_fixed(ts__req *r)
{
    const ts__msg_op *info = ts__msg_op_info(r->op);
    assert(info != NULL && info->upload && info->upload_fixed > 0);
    (void)info;
    /* The head ts__req_body wrote: u8 name length, the name, then the fixed fields. */
    uint8_t *body = r->small + TS_HDR_SIZE;
    return body + 1 + body[0];
}

/* A write buffer; built by hand because uv_buf_init takes an unsigned int length. */
static uv_buf_t mkbuf(const void *p, size_t len)
{
    uv_buf_t b;
    b.base = (char *)p;
    b.len = len;
    return b;
}

/*
 * Get r ready to be written on the current connection: checks, request id, header. Returns 0
 * when it is, or -1 when r has been completed instead (an error).
 */
static int req_prepare(ts_client_t *c, ts__req *r)
{
    ts__conn *conn = c->conn;
    /* Set first: a HELLO completed with an error below must still end its connection attempt. */
    r->conn = conn;
    if ((r->hflags & TS_FLAG_LZ4) && !conn->lz4) {
        int rc = inflate_body(r);
        if (rc != 0) {
            ts__req_finish(c, r, rc);
            return -1;
        }
    }
    if (r->body_len > conn->max_body) {
        char msg[128];
        int n = snprintf(msg, sizeof(msg), "a %llu-byte frame exceeds the server's limit (%llu)",
                         (unsigned long long)r->body_len, (unsigned long long)conn->max_body);
        r->msg = ts__strndup(msg, (size_t)n);
        ts__req_finish(c, r, TS_EMSGSIZE);
        return -1;
    }
    if (r->kind == TS__K_BLOCK) {
        pthread_mutex_lock(&c->mu);
        int abandoned = ts__req_abandoned_locked(r);
        if (!abandoned)
            r->wbusy = 1;
        pthread_mutex_unlock(&c->mu);
        if (abandoned) {
            ts__req_finish(c, r, TS_ETIMEDOUT);
            return -1;
        }
    }
    uint32_t id;
    do {
        id = c->next_id++ & ~TS__DIRECT_ID;
    } while (id == 0 || ts__idmap_get(&c->inflight, id) != NULL);
    if (ts__idmap_put(&c->inflight, id, r) != 0) {
        ts__req_finish(c, r, TS_ENOMEM);
        return -1;
    }
    r->in_map = 1;
    ts__req_header(r, id);
    return 0;
}

void ts__req_header(ts__req *r, uint32_t id)
{
    r->id = id;
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = r->op,
                 .flags = r->hflags,
                 .request_id = id,
                 .body_len = r->body_len};
    ts__hdr_encode(&h, r->small);
}

/* Number of write buffers r's frame needs. */
size_t ts__req_nbufs(const ts__req *r)
{
    return 1 + (r->flat != NULL ? 1 : 0) + (r->enc.head != NULL ? 1 + 2 * r->enc.nsegs : 0);
}

/* Header + fixed part, then either one flat buffer or the plan's head and segments. */
size_t ts__req_fill_bufs(const ts__req *r, uv_buf_t *bufs)
{
    size_t n = 0;
    bufs[n++] = mkbuf(r->small, TS_HDR_SIZE + r->small_len);
    if (r->flat != NULL && r->flat_len > 0)
        bufs[n++] = mkbuf(r->flat, r->flat_len);
    if (r->enc.head != NULL) {
        bufs[n++] = mkbuf(r->enc.head, r->enc.head_len);
        for (size_t i = 0; i < r->enc.nsegs; i++) {
            const ts__seg *s = &r->enc.segs[i];
            if (s->len > 0)
                bufs[n++] = mkbuf(s->ptr, s->len);
            if (s->pad_after > 0)
                bufs[n++] = mkbuf(ts__zeros, s->pad_after);
        }
    }
    return n;
}

/* Write r's frame on the current connection (header + fixed part, then the record). */
void ts__req_send(ts_client_t *c, ts__req *r)
{
    if (req_prepare(c, r) != 0)
        return;
    ts__conn *conn = c->conn;
    uv_buf_t local[TS__LOCAL_BUFS];
    size_t nbufs = ts__req_nbufs(r);
    uv_buf_t *bufs = local;
    if (nbufs > TS__ARRAY_SIZE(local)) {
        bufs = ts__malloc(nbufs * sizeof(*bufs));
        if (bufs == NULL) {
            ts__req_complete(c, r, TS_ENOMEM);
            return;
        }
    }
    size_t n = ts__req_fill_bufs(r, bufs);
    ts__io_write_begin(c);
    ts__req_write(c, conn, r, bufs, n);
    if (bufs != local)
        ts__free(bufs);
}

void ts__req_write(ts_client_t *c, ts__conn *conn, ts__req *r, const uv_buf_t *bufs, size_t n)
{
    r->w.data = r;
    r->wstate = TS__W_PENDING;
    /* libuv copies the buffer array; the memory it points to stays ours until ts__write_cb. */
    int rc = ts__conn_write(conn, &r->w, bufs, (unsigned)n, ts__write_cb);
    if (rc != 0) {
        ts__io_write_end(c);
        r->wstate = TS__W_NONE;
        ts__req_complete(c, r, TS_ECONNRESET);
        ts__conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    ts__ensure_tick(c);
}

/* Several requests written with one uv_write; freed by its callback. */
typedef struct ts__wbatch {
    uv_write_t w;
    ts_client_t *c;
    ts__conn *conn;
    size_t n;
    ts__req *reqs[];
} ts__wbatch;

static void batch_write_cb(uv_write_t *w, int status)
{
    ts__wbatch *b = w->data;
    ts_client_t *c = b->c;
    ts__conn *conn = b->conn;
    ts__io_write_end(c);
    /* Every request of the batch is released before a failure fails the ones in flight. */
    for (size_t i = 0; i < b->n; i++)
        write_done(c, b->reqs[i]);
    ts__free(b);
    if (status < 0 && conn == c->conn && conn != NULL)
        ts__conn_fail(c, conn, TS_ECONNRESET, "write to the server failed");
}

/*
 * Write n requests on the current connection with one uv_write (one system call when the socket
 * takes it all): a burst of small asynchronous requests, such as a pipeline refilled from
 * completion callbacks, would otherwise cost a write system call each. Requests that fail their
 * checks are completed on the way; the others behave exactly as if sent by ts__req_send.
 */
void ts__req_send_batch(ts_client_t *c, ts__req **reqs, size_t n)
{
    ts__wbatch *b = n > 1 ? ts__malloc(sizeof(*b) + n * sizeof(ts__req *)) : NULL;
    if (b == NULL) {
        for (size_t i = 0; i < n; i++) {
            if (c->state == TS__ST_READY) {
                ts__req_send(c, reqs[i]);
            } else {
                ts__append_waitq(c, reqs[i]);
                ts__ensure_tick(c);
            }
        }
        return;
    }
    b->c = c;
    b->conn = c->conn;
    b->n = 0;
    size_t nbufs = 0;
    for (size_t i = 0; i < n; i++) {
        if (req_prepare(c, reqs[i]) != 0)
            continue;
        b->reqs[b->n++] = reqs[i];
        nbufs += ts__req_nbufs(reqs[i]);
    }
    if (b->n == 0) {
        ts__free(b);
        return;
    }
    uv_buf_t local[TS__LOCAL_BUFS];
    uv_buf_t *bufs = nbufs > TS__ARRAY_SIZE(local) ? ts__malloc(nbufs * sizeof(*bufs)) : local;
    int rc = UV_ENOMEM;
    if (bufs != NULL) {
        size_t k = 0;
        for (size_t i = 0; i < b->n; i++) {
            b->reqs[i]->wstate = TS__W_PENDING;
            k += ts__req_fill_bufs(b->reqs[i], bufs + k);
        }
        b->w.data = b;
        ts__io_write_begin(c);
        /* libuv copies the buffer array; the memory it points to stays ours until the cb. */
        rc = ts__conn_write(b->conn, &b->w, bufs, (unsigned)k, batch_write_cb);
        if (bufs != local)
            ts__free(bufs);
        if (rc != 0)
            ts__io_write_end(c);
    }
    if (rc != 0) {
        ts__conn *conn = b->conn;
        for (size_t i = 0; i < b->n; i++) {
            b->reqs[i]->wstate = TS__W_NONE;
            ts__req_complete(c, b->reqs[i], rc == UV_ENOMEM ? TS_ENOMEM : TS_ECONNRESET);
        }
        ts__free(b);
        if (rc != UV_ENOMEM)
            ts__conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return;
    }
    ts__ensure_tick(c);
}

/*
 * Send UNLISTEN for bin and ignore the answer (a listener nobody waits for any more). It goes
 * through the inbox like an application's request, so it is written after a direct write that
 * the I/O thread has yet to finish (see ts__submit_blocking_locked).
 */
void ts__send_fire_unlisten(ts_client_t *c, const char *bin, size_t len)
{
    if (c->state != TS__ST_READY)
        return; /* the server forgets listeners with their connection */
    ts__req *r = ts__calloc(1, sizeof(*r));
    if (r == NULL)
        return;
    r->c = c;
    r->kind = TS__K_FIRE;
    r->op = TS_OP_UNLISTEN;
    ts__msg_name_req m = {.name = (const uint8_t *)bin, .name_len = len};
    if (ts__req_body(r, &m) != 0 || ts__submit(c, r) != 0)
        ts__req_free(r);
}
