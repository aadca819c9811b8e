/*
 * Reading replies (I/O thread): the staging buffer and the large-body buffers libuv reads into,
 * the header check every reply passes before its body is read, dispatching a frame to the
 * request it answers or to the subscription it notifies, and applying a reply to its request
 * (which a blocking caller reading its own reply does too, see direct.c).
 */
#include "internal.h"

#include "compress.h"
#include "msg.h"

#include <stdio.h>

/* ---------------------------------------------------------------------------------------------
 * Reading
 */

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    ts__conn *conn = h->data;
    (void)suggested;
    if (conn->rstate == TS__RS_BODY) {
        /* Large bodies are read straight into their own aligned buffer. */
        buf->base = (char *)conn->body + conn->body_got;
        buf->len = (size_t)(conn->hdr.body_len - conn->body_got);
    } else {
        buf->base = (char *)conn->stage + conn->stage_len;
        buf->len = TS__STAGE_SIZE - conn->stage_len;
    }
}

/* 1 when a request waits for the reply with this id (it stays where it is). */
static int reply_awaited(ts_client_t *c, uint32_t id)
{
    if (ts__idmap_get(&c->inflight, id) != NULL)
        return 1;
    if (!(id & TS__DIRECT_ID))
        return 0;
    pthread_mutex_lock(&c->mu);
    int found = ts__idmap_get(&c->direct, id) != NULL;
    pthread_mutex_unlock(&c->mu);
    return found;
}

/* The request a reply with this id answers, or NULL (one that timed out, say). */
static ts__req *reply_owner(ts_client_t *c, uint32_t id)
{
    ts__req *r = ts__idmap_get(&c->inflight, id);
    return r != NULL ? r : ts__direct_take(c, id);
}

/*
 * Check a reply header against what its opcode and status allow, before its body is read or
 * allocated (docs/PROTOCOL.md sections 5 and 12), with the codec's bound for its body
 * (ts__msg_reply_limit: the exact size of fixed replies, TS_MAX_ERRMSG for error bodies, the
 * client's max_reply_bytes for GET, PEEK, LIST and STATS). lz4 says
 * whether the connection agreed on compressed bodies. 0, or TS_EPROTO. No system call, no
 * allocation: both read paths run it on every frame.
 */
int ts__reply_hdr_check(const ts_client_t *c, const ts__hdr *h, int lz4)
{
    if (h->opcode == 0 ? h->status == TS_ST_OK || h->request_id != 0
                       : (h->opcode == TS_OP_NOTIFY || h->opcode == TS_OP_SVC_REQUEST) &&
                             (h->status != 0 || h->request_id != 0))
        return TS_EPROTO; /* a connection-level error frame, or a notification, out of shape */
    uint64_t max = ts__msg_reply_limit(h->opcode, h->status, c->opts.max_reply_bytes);
    if (h->flags & TS_FLAG_LZ4) {
        if (!lz4)
            return TS_EPROTO;
        /* raw_len, then LZ4's worst case for max bytes (n + n/255 + 16); max <= 2^40. */
        max = 8 + max + max / 255 + 16;
    }
    return h->body_len <= max ? 0 : TS_EPROTO;
}

/* Why ts__reply_hdr_check refused h, in buf (n bytes): a body over its bound is named as such. */
static const char *hdr_refusal(const ts_client_t *c, const ts__hdr *h, char *buf, size_t n)
{
    uint64_t max = ts__msg_reply_limit(h->opcode, h->status, c->opts.max_reply_bytes);
    if (h->opcode == 0 || (h->flags & TS_FLAG_LZ4) != 0 || h->body_len <= max)
        return "malformed frame from the server";
    if (h->status == TS_ST_OK && max == c->opts.max_reply_bytes)
        snprintf(buf, n, "a %s reply of %llu bytes is over the client's max_reply_bytes (%llu)",
                 ts__op_name(h->opcode), (unsigned long long)h->body_len, (unsigned long long)max);
    else
        snprintf(buf, n, "a %s reply of %llu bytes is over the %llu its kind may have",
                 ts__op_name(h->opcode), (unsigned long long)h->body_len, (unsigned long long)max);
    return buf;
}

/*
 * Deliver a NOTIFY frame to the subscription for its bin. Returns 0, or TS_EPROTO when the body
 * is malformed. A notification whose event the client does not know (PROTOCOL.md 8.14: a client
 * MUST ignore it) is dropped and the connection kept.
 */
static int dispatch_notify(ts_client_t *c, const uint8_t *body, size_t len)
{
    ts__msg_notify m;
    if (ts__msg_notify_decode(body, len, &m) != 0)
        return TS_EPROTO;
    if (m.event < TS_NOTE_PUT || m.event > TS_NOTE_ROWS)
        return 0;
    ts__sub *s;
    pthread_mutex_lock(&c->mu);
    for (s = c->subs; s != NULL; s = s->next)
        if (s->live && s->bin_len == m.name_len && memcmp(s->bin, m.name, m.name_len) == 0)
            break;
    if (s != NULL)
        atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    pthread_mutex_unlock(&c->mu);
    if (s == NULL)
        return 0; /* unlistened meanwhile, or never ours */
    s->version = m.version;
    s->n_items = m.n_items;
    ts__sub_event(c, s, (ts_event_t)m.event, (m.flags & TS_NOTE_FLAG_COALESCED) != 0);
    ts__sub_unref(s);
    return 0;
}

/*
 * The server broke the protocol in its answer to r: drop the connection first (so r's callback
 * already sees it down and what it submits waits for the reconnection), then fail r with
 * TS_EPROTO. The other requests in flight fail with TS_EPROTO too (see ts__conn_fail).
 */
static void proto_fail(ts_client_t *c, ts__conn *conn, ts__req *r, const char *msg)
{
    if (r->in_map) {
        ts__idmap_del(&c->inflight, r->id);
        r->in_map = 0;
    }
    ts__conn_fail(c, conn, TS_EPROTO, msg);
    ts__req_complete(c, r, TS_EPROTO);
}

/*
 * The server's connection-level error frame (opcode 0, request id 0, checked by
 * ts__reply_hdr_check): it closes the connection for a reason of its own (too many clients, a slow
 * reader, shutdown...). The connection goes now, and the requests in flight fail with the
 * status's TS_E* code and the server's message (ts_last_error()), not as merely lost.
 */
static void server_closing(ts_client_t *c, ts__conn *conn, const ts__hdr *h, const uint8_t *body,
                           size_t len)
{
    int err = ts__status_to_err(h->status);
    char msg[TS_MAX_ERRMSG + 1];
    ts__msg_error e;
    if (!(h->flags & TS_FLAG_LZ4) && ts__msg_error_decode(body, len, &e) == 0 && e.len > 0)
        snprintf(msg, sizeof(msg), "%.*s", (int)e.len, e.msg); /* e.len <= TS_MAX_ERRMSG */
    else
        snprintf(msg, sizeof(msg), "the server closed the connection: %s", ts_strerror(err));
    ts__conn_fail_reason(c, conn, err, msg, 1);
}

/* Release a frame body that dispatch owns; a borrowed one lies in the staging buffer. */
static void body_release(uint8_t *body, size_t len, int owned)
{
    if (owned)
        ts__body_free(body, len);
}

/*
 * Apply the reply frame h with body to r: its status, message and results. With owned, body is
 * an aligned allocation that this takes over; otherwise it is borrowed (valid until this
 * returns) and copied only when the reply keeps it (the decoded tensors of GET, PEEK and STATS
 * point into their body). Returns the request's status; *malformed is set when the frame broke
 * the protocol (the connection has to go): a body that does not decode, a compressed body that
 * does not inflate, a body over its bound, or tensord's own BAD_REQUEST, but not a status that a
 * service answered an SVC_CALL with. Touches nothing but r, so it runs on the I/O thread and on
 * a blocking caller reading its own reply alike.
 */
int ts__reply_apply(ts__req *r, const ts__hdr *h, uint8_t *body, size_t len, int owned,
                    int *malformed)
{
    *malformed = 0;
    /* What the reply may hold (ts__reply_hdr_check checked the header against it already). */
    uint64_t max = ts__msg_reply_limit(h->opcode, h->status, r->c->opts.max_reply_bytes);
    if (h->flags & TS_FLAG_LZ4) {
        uint64_t raw = 0;
        uint8_t *out = NULL;
        int rc = ts__lz4_raw_len(body, len, &raw);
        if (rc == 0 && (ts__lz4_bound(raw) == 0 || raw > max))
            rc = TS_EPROTO;
        if (rc == 0 && raw > 0 && (out = ts__malloc_aligned(raw)) == NULL)
            rc = TS_ENOMEM;
        if (rc == 0)
            rc = ts__lz4_decompress(body, len, out, raw);
        body_release(body, len, owned);
        if (rc != 0) {
            ts__free_aligned(out, raw);
            *malformed = rc == TS_EPROTO;
            return rc;
        }
        body = out;
        len = raw;
        owned = 1;
    }
    int status;
    int relayed = 0; /* the status is a service's answer, not the server's verdict */
    if (len > max) {
        status = TS_EPROTO;
        body_release(body, len, owned);
    } else if (h->status != TS_ST_OK) {
        status = ts__status_to_err(h->status);
        ts__msg_error e;
        if (ts__msg_reply_kind(h->opcode, h->status) == TS_MSG_BIN_STATE) {
            /* WAIT's TIMEOUT carries the bin state, exactly. */
            if (ts__reply_bin_state(r, body, len) != 0)
                status = TS_EPROTO;
        } else if (ts__msg_reply_kind(h->opcode, h->status) == TS_MSG_WRONG_SHARD) {
            /* Where the name belongs, for a cluster client's redirect (cluster.c). */
            if (ts__reply_wrong_shard(r, body, len) != 0)
                status = TS_EPROTO;
        } else if (ts__msg_error_decode(body, len, &e) != 0) {
            status = TS_EPROTO;
        } else {
            /*
             * An SVC_CALL's error is what the service answered, relayed by tensord on a
             * connection it keeps open (PROTOCOL.md 8.53): BAD_REQUEST included, it ends this
             * call only. Any other request's BAD_REQUEST is tensord's own, and the connection
             * goes (tensord closes it too).
             */
            relayed = r->op == TS_OP_SVC_CALL;
            if (e.len > 0)
                r->msg = ts__strndup(e.msg, e.len); /* on failure the status alone tells */
        }
        body_release(body, len, owned);
    } else if (!ts__reply_keeps_body(r->op)) {
        status = ts__reply_parse_view(r, body, len);
        body_release(body, len, owned);
    } else {
        if (!owned) {
            /*
             * A borrowed body lies in a receive buffer: the parser takes over (and frees) what
             * it is given, so it gets a copy, or no buffer at all for an empty body.
             */
            uint8_t *copy = NULL;
            if (len > 0 && (copy = ts__malloc_aligned(len)) == NULL)
                return TS_ENOMEM;
            if (len > 0)
                memcpy(copy, body, len);
            body = copy;
        }
        status = ts__reply_parse(r, body, len);
    }
    /* A HELLO's own completion drops the connection (ts__hello_done). */
    *malformed = status == TS_EPROTO && !relayed && r->kind != TS__K_HELLO;
    return status;
}

/*
 * Handle one complete frame from conn. With owned, body is an aligned allocation that dispatch
 * takes over; otherwise it is borrowed from the staging buffer (valid until dispatch returns)
 * and copied only when the reply keeps it (the decoded tensors of GET, PEEK and STATS point
 * into their body), so that small replies and notifications cost no allocation. Returns 0, or
 * TS_EPROTO when the frame broke the protocol in a way that ends the connection (already
 * dropped when a request was concerned; the caller drops it otherwise).
 */
static int dispatch(ts_client_t *c, ts__conn *conn, const ts__hdr *h, uint8_t *body, size_t len,
                    int owned)
{
    if (h->opcode == TS_OP_NOTIFY) {
        int rc = dispatch_notify(c, body, len);
        body_release(body, len, owned);
        return rc;
    }
    if (h->opcode == TS_OP_SVC_REQUEST)
        return ts__svc_push(c, body, len, owned); /* service.c; takes the body over */
    if (h->opcode == 0) {
        server_closing(c, conn, h, body, len);
        body_release(body, len, owned);
        return TS_EPROTO; /* the connection is gone already */
    }
    ts__req *r = reply_owner(c, h->request_id);
    if (r == NULL) {
        body_release(body, len, owned); /* the answer to a request that timed out */
        return 0;
    }
    if (r->op != h->opcode) {
        body_release(body, len, owned);
        proto_fail(c, conn, r, "the server answered a request with another opcode");
        return TS_EPROTO;
    }
    int malformed = 0;
    int status = ts__reply_apply(r, h, body, len, owned, &malformed);
    if (malformed) {
        proto_fail(c, conn, r,
                   status == TS_EPROTO && (h->flags & TS_FLAG_LZ4)
                       ? "malformed compressed reply from the server"
                       : "malformed reply from the server");
        return TS_EPROTO;
    }
    ts__req_complete(c, r, status);
    return 0;
}

/* Parse every whole frame in the staging buffer; keep a partial one for the next read. */
void ts__process_stage(ts_client_t *c, ts__conn *conn)
{
    size_t pos = 0;
    while (!conn->closing) {
        size_t avail = conn->stage_len - pos;
        if (conn->discard > 0) {
            size_t k = conn->discard < avail ? (size_t)conn->discard : avail;
            pos += k;
            conn->discard -= k;
            if (conn->discard > 0)
                break;
            continue;
        }
        if (avail < TS_HDR_SIZE)
            break;
        ts__hdr h;
        if (ts__hdr_decode(conn->stage + pos, TS_MAGIC_REP, &h) != 0) {
            ts__conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
            return;
        }
        if (ts__reply_hdr_check(c, &h, conn->lz4) != 0) {
            char why[160];
            ts__conn_fail(c, conn, TS_EPROTO, hdr_refusal(c, &h, why, sizeof(why)));
            return;
        }
        pos += TS_HDR_SIZE;
        avail -= TS_HDR_SIZE;
        if (h.body_len <= avail) {
            /* The whole body is here: dispatch reads it in place (see dispatch). */
            uint8_t *body = h.body_len > 0 ? conn->stage + pos : NULL;
            pos += (size_t)h.body_len;
            if (dispatch(c, conn, &h, body, (size_t)h.body_len, 0) != 0)
                ts__conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
            continue;
        }
        if (h.opcode != TS_OP_NOTIFY && h.opcode != TS_OP_SVC_REQUEST && h.opcode != 0 &&
            !reply_awaited(c, h.request_id)) {
            /* The late answer to a request that timed out: skip it, buffering nothing. */
            conn->discard = h.body_len;
            continue;
        }
        uint8_t *body = ts__malloc_aligned((size_t)h.body_len);
        if (body == NULL) {
            /* No memory for this body: fail its request and skip the bytes. */
            ts__req *r = h.opcode != TS_OP_NOTIFY && h.opcode != TS_OP_SVC_REQUEST
                             ? reply_owner(c, h.request_id)
                             : NULL;
            if (r != NULL)
                ts__req_complete(c, r, TS_ENOMEM);
            conn->discard = h.body_len;
            continue;
        }
        memcpy(body, conn->stage + pos, avail);
        pos += avail;
        conn->hdr = h;
        conn->body = body;
        conn->body_got = avail;
        conn->rstate = TS__RS_BODY;
        break;
    }
    if (conn->closing)
        return;
    memmove(conn->stage, conn->stage + pos, conn->stage_len - pos);
    conn->stage_len -= pos;
}

static void read_cb(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    ts__conn *conn = stream->data;
    ts_client_t *c = conn->c;
    (void)buf;
    if (conn->closing || nread == 0)
        return;
    int tls_err;
    const char *tls_msg;
    if (nread < 0 && ts__conn_tls_failed(conn, &tls_err, &tls_msg)) {
        /* A handshake refused (a certificate that failed verification...) is a verdict. */
        char msg[320];
        snprintf(msg, sizeof(msg), "TLS: %s", tls_msg);
        ts__conn_fail_reason(c, conn, tls_err, msg, 1);
        return;
    }
    if (nread < 0) {
        ts__conn_fail(c, conn, TS_ECONNRESET,
                      nread == UV_EOF ? "the server closed the connection"
                                      : uv_strerror((int)nread));
        return;
    }
    if (conn->rstate == TS__RS_BODY) {
        conn->body_got += (size_t)nread;
        if (conn->body_got < conn->hdr.body_len)
            return;
        uint8_t *body = conn->body;
        ts__hdr h = conn->hdr;
        conn->body = NULL;
        conn->rstate = TS__RS_HDR;
        if (dispatch(c, conn, &h, body, (size_t)h.body_len, 1) != 0)
            ts__conn_fail(c, conn, TS_EPROTO, "malformed frame from the server");
        return;
    }
    conn->stage_len += (size_t)nread;
    ts__process_stage(c, conn);
}

int ts__read_start(ts_client_t *c, ts__conn *conn)
{
    int rc = ts__conn_read_start(conn, alloc_cb, read_cb);
    if (rc != 0) {
        ts__conn_fail(c, conn, TS_ECONNRESET, uv_strerror(rc));
        return -1;
    }
    c->reading = 1;
    return 0;
}
