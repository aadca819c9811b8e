/*
 * Request handlers: one function per opcode. Each parses its body with the bounded reader
 * (a malformed body is a protocol error), acts on the store, queues exactly one reply with the
 * request's opcode and id, and then, for changes, notifies listeners and waiters (so the
 * writer's own reply always comes before its notification).
 */
#include "server.h"

/* Room for a printable bin name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define TSD_NAME_MSG_CAP (TS_MAX_NAME_LEN * 4 + 1)

int tsd_auth_check(tsd_server *srv, const uint8_t *token, size_t len)
{
    const uint8_t *want = srv->cfg.auth_token;
    size_t wlen = srv->cfg.auth_token_len;
    if (want == NULL)
        return 0;
    /*
     * Every byte of the configured token is compared, whatever was presented and wherever the
     * first difference is, so the time taken tells an attacker nothing about how close a guess
     * was. The presented bytes are read cyclically (or a zero byte when none were given).
     */
    volatile uint8_t diff = 0;
    for (size_t i = 0; i < wlen; i++) {
        uint8_t got = len > 0 ? token[i % len] : 0;
        diff |= (uint8_t)(want[i] ^ got);
    }
    size_t ldiff = len ^ wlen;
    for (size_t k = 0; k < sizeof(ldiff); k++)
        diff |= (uint8_t)(ldiff >> (8 * k));
    return diff == 0 ? 0 : TS_EAUTH;
}

/* 0 when the reader consumed the body exactly, else -1 (short or trailing bytes). */
static int rd_done(const ts__rd *r)
{
    return r->err == 0 && r->left == 0 ? 0 : -1;
}

static void malformed(tsd_conn *c, const ts__hdr *h)
{
    tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "malformed %s body",
                  ts__op_name(h->opcode));
}

static void reply_not_found(tsd_conn *c, const ts__hdr *h, const char *what, const uint8_t *name,
                            size_t nl)
{
    char pn[TSD_NAME_MSG_CAP];
    tsd_name_printable(name, nl, pn, sizeof(pn));
    tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND, "%s: %s", what, pn);
}

static void op_hello(tsd_conn *c, const ts__hdr *h, ts__rd *r)
{
    tsd_server *srv = c->srv;
    uint8_t max_version = 0, flags = 0;
    uint16_t tlen = 0;
    ts__rd_u8(r, &max_version);
    ts__rd_u8(r, &flags);
    ts__rd_u16(r, &tlen);
    const uint8_t *token = ts__rd_bytes(r, tlen);
    if (rd_done(r) != 0) {
        malformed(c, h);
        return;
    }
    if (c->helloed) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST, "duplicate HELLO");
        return;
    }
    if (max_version < TS_PROTO_VERSION) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNSUPPORTED_VERSION,
                      "client speaks up to version %u, this server needs %u", max_version,
                      TS_PROTO_VERSION);
        return;
    }
    if (srv->cfg.auth_token != NULL && tlen == 0) {
        srv->stats.auth_failures++;
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_AUTH_REQUIRED,
                      "this server requires a token (TS_AUTH_TOKEN or the auth_token option)");
        return;
    }
    if (tsd_auth_check(srv, token, tlen) != 0) {
        srv->stats.auth_failures++;
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_AUTH_FAILED,
                      "authentication failed: wrong token");
        return;
    }
    c->helloed = 1;
    c->lz4 = (flags & TS_HELLO_LZ4) != 0;
    uint8_t body[24];
    body[0] = TS_PROTO_VERSION;
    body[1] = c->lz4 ? TS_HELLO_LZ4 : 0;
    ts__put_u16le(body + 2, 0);
    ts__put_u32le(body + 4, 0);
    ts__put_u64le(body + 8, srv->cfg.max_frame);
    ts__put_u64le(body + 16, srv->server_id);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, sizeof(body));
}

/* GET (remove = 1) and PEEK: the oldest max_items items of a bin as a TS_ITEMS reply. */
static void op_get(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                   uint32_t max_items, int remove)
{
    tsd_server *srv = c->srv;
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    if (bin == NULL) {
        reply_not_found(c, h, "no such bin", name, nl);
        return;
    }
    /* A connection that takes no more output changes nothing: the items would be lost. */
    if (tsd_out_begin(c, h->opcode, h->request_id) != 0)
        return;
    uint32_t n = bin->n_items;
    if (max_items != 0 && max_items < n)
        n = max_items;
    uint64_t body_len = ts__items_head_size(n);
    tsd_item *it = bin->head;
    for (uint32_t i = 0; i < n; i++, it = it->next)
        body_len += ts__align_up(tsd_item_len(it), TS__ALIGN);
    uint64_t version = remove ? srv->version + 1 : bin->version;
    uint32_t remaining = bin->n_items - (remove ? n : 0);

    if (tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) != 0)
        return;
    size_t head = (size_t)ts__items_head_size(n);
    uint8_t *p = tsd_out_bytes(c, head);
    if (p == NULL)
        return;
    memset(p, 0, head);
    ts__put_u64le(p, version);
    ts__put_u32le(p + 8, n);
    ts__put_u32le(p + 12, remaining);
    it = bin->head;
    for (uint32_t i = 0; i < n; i++, it = it->next)
        ts__put_u64le(p + 16 + 8 * (size_t)i, tsd_item_len(it));

    /*
     * The reply holds its own references. Only once it is queued whole do the items leave the
     * bin: a reply that fails for lack of memory leaves the bin as it was.
     */
    it = bin->head;
    for (uint32_t i = 0; i < n && it != NULL; i++, it = it->next)
        if (tsd_out_item(c, it, 1) != 0)
            return;
    if (!remove)
        return;
    version = tsd_server_next_version(srv);
    for (uint32_t i = 0; i < n; i++)
        tsd_item_unref(tsd_store_pop(&srv->store, bin));
    if (bin->n_items == 0)
        tsd_store_remove(&srv->store, bin);
    else
        bin->version = version;
    tsd_notify_change(srv, name, nl, version, remaining, TS_NOTE_GET);
}

void tsd_op_store(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                  tsd_item *item)
{
    tsd_server *srv = c->srv;
    int replace = h->opcode == TS_OP_PUT;
    srv->stats.ops[h->opcode]++;
    uint64_t version = tsd_server_next_version(srv);
    tsd_bin *bin = tsd_store_add(&srv->store, name, name_len, item, replace, version);
    if (bin == NULL) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory adding a bin");
        return;
    }
    uint32_t n = bin->n_items;
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, n);
    tsd_notify_change(srv, name, name_len, version, n, replace ? TS_NOTE_PUT : TS_NOTE_APPEND);
}

static void op_delete(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    tsd_server *srv = c->srv;
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    if (bin == NULL) {
        /* As in the original: deleting a missing bin is fine and notifies nobody. */
        tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, 0, 0);
        return;
    }
    uint32_t n = bin->n_items;
    uint64_t version = tsd_server_next_version(srv);
    tsd_store_remove(&srv->store, bin);
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, n);
    tsd_notify_change(srv, name, nl, version, 0, TS_NOTE_DELETE);
}

static void op_list(tsd_conn *c, const ts__hdr *h)
{
    tsd_server *srv = c->srv;
    tsd_bin **bins;
    size_t n;
    if (tsd_store_sorted(&srv->store, &bins, &n) != 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory listing bins");
        return;
    }
    uint64_t body_len = 8;
    for (size_t i = 0; i < n; i++)
        body_len += 1 + (uint64_t)bins[i]->node.name_len + 20;
    if (tsd_out_begin(c, h->opcode, h->request_id) == 0 &&
        tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) == 0) {
        uint8_t *p = tsd_out_bytes(c, (size_t)body_len);
        if (p != NULL) {
            ts__put_u32le(p, (uint32_t)n);
            ts__put_u32le(p + 4, 0);
            p += 8;
            for (size_t i = 0; i < n; i++) {
                const tsd_bin *b = bins[i];
                *p++ = b->node.name_len;
                memcpy(p, b->node.name, b->node.name_len);
                p += b->node.name_len;
                ts__put_u32le(p, b->n_items);
                ts__put_u64le(p + 4, b->bytes);
                ts__put_u64le(p + 12, b->version);
                p += 20;
            }
        }
    }
    ts__free(bins);
}

static void op_listen(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    tsd_server *srv = c->srv;
    int rc = tsd_listen(srv, c, name, nl);
    if (rc == TS_ETOOMANY) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "too many subscriptions and pending waits on this connection "
                      "(--max-watch)");
        return;
    }
    if (rc == TS_EOOM) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory) subscribing");
        return;
    }
    if (rc != 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory subscribing");
        return;
    }
    /* The subscription is live before this reply leaves: no change can slip in between. */
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, bin != NULL ? bin->version : 0,
                    bin != NULL ? bin->n_items : 0);
}

static void op_unlisten(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    if (tsd_unlisten(c->srv, c, name, nl) != 0) {
        reply_not_found(c, h, "not listening to bin", name, nl);
        return;
    }
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, NULL, 0);
}

static void op_wait(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl, uint64_t after,
                    uint32_t timeout_ms)
{
    tsd_server *srv = c->srv;
    /*
     * The rule, here as on every later change (notify.c): the bin exists and its version is
     * above after. A missing bin (never made, emptied by GET, deleted) has version 0 and never
     * satisfies a waiter, so a removal cannot wake anybody into finding nothing.
     */
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    uint64_t version = bin != NULL ? bin->version : 0;
    uint32_t n = bin != NULL ? bin->n_items : 0;
    if (bin != NULL && version > after) {
        tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, n);
        return;
    }
    if (timeout_ms == 0) {
        tsd_reply_state(c, h->opcode, h->request_id, TS_ST_TIMEOUT, version, n);
        return;
    }
    if (timeout_ms > TSD_MAX_WAIT_MS)
        timeout_ms = TSD_MAX_WAIT_MS;
    int rc = tsd_wait_add(srv, c, h->request_id, name, nl, after, timeout_ms);
    if (rc == TS_ETOOMANY)
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "too many subscriptions and pending waits on this connection "
                      "(--max-watch)");
    else if (rc == TS_EOOM)
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory) waiting");
    else if (rc != 0)
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory waiting");
}

void tsd_op_dispatch(tsd_conn *c, const ts__hdr *h, const uint8_t *body, size_t len)
{
    tsd_server *srv = c->srv;
    ts__rd r;
    ts__rd_init(&r, body, len);
    const char *cname = NULL;
    size_t nl = 0;
    uint32_t u32 = 0;
    uint64_t u64 = 0;

    srv->stats.ops[h->opcode]++;
    /* GET and DELETE remove items: refused like PUT/APPEND while snapshots fail. */
    if ((h->opcode == TS_OP_GET || h->opcode == TS_OP_DELETE) && tsd_writes_refused(srv)) {
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    switch (h->opcode) {
    case TS_OP_HELLO:
        op_hello(c, h, &r);
        return;
    case TS_OP_PING:
    case TS_OP_LIST:
    case TS_OP_STATS:
    case TS_OP_SAVE:
        if (len != 0) {
            malformed(c, h);
            return;
        }
        if (h->opcode == TS_OP_PING)
            tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, NULL, 0);
        else if (h->opcode == TS_OP_LIST)
            op_list(c, h);
        else if (h->opcode == TS_OP_STATS)
            tsd_stats_reply(c, h);
        else if (srv->cfg.save_path == NULL)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID, "snapshots not configured");
        else
            tsd_snapshot_request(srv, c, h->request_id);
        return;
    case TS_OP_GET:
    case TS_OP_PEEK:
        ts__rd_name(&r, &cname, &nl);
        ts__rd_u32(&r, &u32);
        if (rd_done(&r) != 0) {
            malformed(c, h);
            return;
        }
        op_get(c, h, (const uint8_t *)cname, nl, u32, h->opcode == TS_OP_GET);
        return;
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_UNLISTEN:
        ts__rd_name(&r, &cname, &nl);
        if (rd_done(&r) != 0) {
            malformed(c, h);
            return;
        }
        if (h->opcode == TS_OP_DELETE)
            op_delete(c, h, (const uint8_t *)cname, nl);
        else if (h->opcode == TS_OP_LISTEN)
            op_listen(c, h, (const uint8_t *)cname, nl);
        else
            op_unlisten(c, h, (const uint8_t *)cname, nl);
        return;
    case TS_OP_WAIT:
        ts__rd_name(&r, &cname, &nl);
        ts__rd_u64(&r, &u64);
        ts__rd_u32(&r, &u32);
        if (rd_done(&r) != 0) {
            malformed(c, h);
            return;
        }
        op_wait(c, h, (const uint8_t *)cname, nl, u64, u32);
        return;
    default:
        /* check_header admits only known request opcodes; PUT/APPEND never come here. */
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x",
                      h->opcode);
        return;
    }
}
