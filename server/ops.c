/*
 * Request handlers: one function per opcode. tsd_op_dispatch decodes each body with the strict
 * decoder of src/msg.c (a malformed body is a protocol error) and every reply body is written by
 * its encoder. PUT and APPEND are not here: conn.c reads their head (ts__msg_put_head_decode) so
 * that the record lands straight in its item, one copy from the kernel. Each handler acts on the
 * store, queues exactly one reply with the request's opcode and id, and then, for changes,
 * notifies listeners and waiters (so the writer's own reply always comes before its
 * notification).
 */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "auth.h"
#include "msg.h"
#include "record.h"
#include "sha256.h"
#include "coord.h"
#include "names.h"
#include "ps.h"
#include "server.h"
#include "service.h"
#include "stream.h"
#include "table.h"

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

/* A request that would replace or take a tensor bin's item (rows.c): INVALID. */
static void reply_tensor_bin(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    char pn[TSD_NAME_MSG_CAP];
    tsd_name_printable(name, nl, pn, sizeof(pn));
    tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                  "%s on tensor bin %s: its rows are written with WRITE_ROWS and read with PEEK "
                  "or the row reads; DELETE it to reuse the name",
                  ts__op_name(h->opcode), pn);
}

/*
 * AUTH_CHALLENGE (before HELLO, once): keep the client's nonce, answer one of our own. Both key
 * the token proof of the HELLO that follows (section 4), so a proof seen on one connection is
 * worth nothing on another.
 */
static void op_auth_challenge(tsd_conn *c, const ts__hdr *h, const ts__msg_auth_nonce *m)
{
    if (c->helloed || c->auth_challenged) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_REQUEST,
                      "AUTH_CHALLENGE is allowed once, before HELLO");
        return;
    }
    uint8_t *cn = c->auth_nonces, *sn = c->auth_nonces + TS_MSG_AUTH_NONCE_SIZE;
    memcpy(cn, m->nonce, TS_MSG_AUTH_NONCE_SIZE);
    if (ts__auth_nonce(sn) != 0) {
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_INTERNAL,
                      "no random bytes for a nonce: %s", strerror(errno));
        return;
    }
    c->auth_challenged = 1;
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, sn, TS_MSG_AUTH_NONCE_SIZE);
}

/*
 * The token check of HELLO (the server has a token and tlen > 0). 0, or -1 after failing c. A
 * proof (TOKEN_PROOF) is checked against the nonces of AUTH_CHALLENGE; a token in clear is
 * taken only with --allow-plain-token.
 */
static int hello_auth(tsd_conn *c, const ts__hdr *h, const ts__msg_hello_req *m)
{
    tsd_server *srv = c->srv;
    const char *why = NULL;
    if (m->flags & TS_HELLO_TOKEN_PROOF) {
        const uint8_t *cn = c->auth_nonces, *sn = c->auth_nonces + TS_MSG_AUTH_NONCE_SIZE;
        uint8_t want[TS_MSG_TOKEN_PROOF_SIZE];
        ts__auth_proof(srv->cfg.auth_token, srv->cfg.auth_token_len, TS_AUTH_CLIENT, cn, sn, want);
        if (!c->auth_challenged)
            why = "TOKEN_PROOF without AUTH_CHALLENGE before HELLO";
        else if (m->token_len != TS_MSG_TOKEN_PROOF_SIZE)
            why = "a token proof is 32 bytes";
        else if (!ts__ct_equal(want, m->token, TS_MSG_TOKEN_PROOF_SIZE))
            why = "authentication failed: wrong token (its proof does not match)";
        ts__wipe(want, sizeof(want));
    } else if (!srv->cfg.allow_plain_token) {
        why = "the token was sent in clear: this server takes only a proof of it (HELLO flag "
              "TOKEN_PROOF after AUTH_CHALLENGE, as tensorshare 0.5.0 clients send); "
              "tensord --allow-plain-token accepts older clients";
    } else if (tsd_auth_check(srv, m->token, m->token_len) != 0) {
        why = "authentication failed: wrong token";
    }
    if (why == NULL)
        return 0;
    srv->stats.auth_failures++;
    tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_AUTH_FAILED, "%s", why);
    return -1;
}

static void op_hello(tsd_conn *c, const ts__hdr *h, const ts__msg_hello_req *m)
{
    tsd_server *srv = c->srv;
    uint8_t max_version = m->max_version;
    uint16_t tlen = m->token_len;
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
    if (srv->cfg.auth_token != NULL && hello_auth(c, h, m) != 0)
        return;
    c->helloed = 1;
    c->lz4 = (m->flags & TS_HELLO_LZ4) != 0;
    /* Descriptors travel only on unix sockets (SCM_RIGHTS), and not with --no-fds. */
    c->fds_ok = (m->flags & TS_HELLO_FDS) != 0 && c->is_unix && !srv->cfg.no_fds;
    ts__msg_hello_rep rep = {
        .version = TS_PROTO_VERSION,
        .flags = (uint8_t)((c->lz4 ? TS_HELLO_LZ4 : 0) | (c->fds_ok ? TS_HELLO_FDS : 0)),
        .max_body = srv->cfg.max_frame,
        .server_id = srv->server_id};
    /*
     * A proof was checked: prove in turn that this server knows the token. A server without a
     * token does not grant the flag (it checked nothing, and has nothing to prove).
     */
    uint8_t proof[TS_MSG_TOKEN_PROOF_SIZE];
    if ((m->flags & TS_HELLO_TOKEN_PROOF) && srv->cfg.auth_token != NULL) {
        ts__auth_proof(srv->cfg.auth_token, srv->cfg.auth_token_len, TS_AUTH_SERVER, c->auth_nonces,
                       c->auth_nonces + TS_MSG_AUTH_NONCE_SIZE, proof);
        rep.flags |= TS_HELLO_TOKEN_PROOF;
        rep.proof = proof;
    }
    uint8_t body[TS_MSG_HELLO_REP_SIZE + TS_MSG_TOKEN_PROOF_SIZE];
    size_t len;
    (void)ts__msg_hello_rep_encode(body, sizeof(body), &rep, &len);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, len);
}

int tsd_reply_items(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t nl,
                    tsd_bin *bin, uint32_t max_items, int remove)
{
    tsd_server *srv = c->srv;
    /* A connection that takes no more output changes nothing: the items would be lost. */
    if (tsd_out_begin(c, op, rid) != 0)
        return -1;
    uint32_t n = bin->n_items;
    if (max_items != 0 && max_items < n)
        n = max_items;
    uint64_t body_len = ts__items_head_size(n);
    tsd_item *it = bin->head;
    for (uint32_t i = 0; i < n; i++, it = it->next)
        body_len += tsd_item_len(it) + ts__msg_items_pad(tsd_item_len(it));
    uint64_t version = remove ? srv->version + 1 : bin->version;
    uint32_t remaining = bin->n_items - (remove ? n : 0);

    if (tsd_out_hdr(c, op, rid, TS_ST_OK, body_len) != 0)
        return -1;
    size_t head = (size_t)ts__items_head_size(n);
    uint8_t *p = tsd_out_bytes(c, head);
    if (p == NULL)
        return -1;
    size_t hlen;
    (void)ts__msg_items_head_encode(p, head, version, n, remaining, NULL, &hlen);
    it = bin->head;
    for (uint32_t i = 0; i < n; i++, it = it->next)
        ts__msg_items_set_len(p, i, tsd_item_len(it));

    /*
     * The reply holds its own references. Only once it is queued whole do the items leave the
     * bin: a reply that fails for lack of memory leaves the bin as it was.
     */
    it = bin->head;
    for (uint32_t i = 0; i < n && it != NULL; i++, it = it->next)
        if (tsd_out_item(c, it, 1) != 0)
            return -1;
    if (!remove)
        return 0;
    version = tsd_server_next_version(srv);
    for (uint32_t i = 0; i < n; i++)
        tsd_item_unref(tsd_store_pop(&srv->store, bin));
    if (bin->n_items == 0)
        tsd_store_remove(&srv->store, bin);
    else
        bin->version = version;
    tsd_notify_change(srv, name, nl, version, remaining, TS_NOTE_GET);
    return 0;
}

/* GET (remove = 1) and PEEK: the oldest max_items items of a bin as a TS_ITEMS reply. */
static void op_get(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                   uint32_t max_items, int remove)
{
    tsd_bin *bin = tsd_store_find(&c->srv->store, name, nl);
    if (bin == NULL) {
        reply_not_found(c, h, "no such bin", name, nl);
        return;
    }
    if (remove && tsd_bin_is_tensor(bin)) {
        reply_tensor_bin(c, h, name, nl);
        return;
    }
    (void)tsd_reply_items(c, h->opcode, h->request_id, name, nl, bin, max_items, remove);
}

void tsd_op_store(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                  tsd_item *item)
{
    tsd_server *srv = c->srv;
    int replace = h->opcode == TS_OP_PUT || h->opcode == TS_OP_PUT_FD;
    srv->stats.ops[h->opcode]++;
    if (tsd_stream_refuse_name(c, h->opcode, h->request_id, name, name_len) ||
        tsd_table_refuse_name(c, h->opcode, h->request_id, name, name_len)) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        return;
    }
    if (tsd_bin_is_tensor(tsd_store_find(&srv->store, name, name_len))) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        reply_tensor_bin(c, h, name, name_len);
        return;
    }
    uint64_t version = tsd_server_next_version(srv);
    tsd_bin *bin = tsd_store_add(&srv->store, name, name_len, item, replace, version);
    if (bin == NULL) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory adding a bin");
        return;
    }
    /* An item in a data-dir file gets its header now, so it is loaded at the next start. */
    (void)tsd_datadir_commit(srv, item, name, name_len, replace ? TSD_DATADIR_REPLACE : 0);
    uint32_t n = bin->n_items;
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, n);
    tsd_notify_change(srv, name, name_len, version, n, replace ? TS_NOTE_PUT : TS_NOTE_APPEND);
}

static void op_delete(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    tsd_server *srv = c->srv;
    tsd_stream *st = tsd_stream_find(srv, name, nl);
    if (st != NULL) {
        tsd_stream_delete(c, h, st); /* stream.c: its waits are answered NOT_FOUND */
        return;
    }
    tsd_table *tb = tsd_table_find(srv, name, nl);
    if (tb != NULL) {
        tsd_table_delete(c, h, tb); /* table.c: its waits are answered NOT_FOUND */
        return;
    }
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

/* Order LIST entries (wire form: u8 name length, then the name) by name bytes, shorter first. */
static int ent_cmp(const void *pa, const void *pb)
{
    const uint8_t *a = *(const uint8_t *const *)pa;
    const uint8_t *b = *(const uint8_t *const *)pb;
    return tsd_name_cmp(a + 1, a[0], b + 1, b[0]);
}

/* One LIST entry in wire form at p (room for ts__msg_list_entry_size); the byte after it. */
static uint8_t *put_entry_of(uint8_t *p, const ts__msg_list_entry *e)
{
    size_t len = 0;
    (void)ts__msg_list_entry_encode(p, ts__msg_list_entry_size(e->name_len), e, &len);
    return p + len;
}

static uint8_t *put_entry(uint8_t *p, const tsd_bin *b)
{
    ts__msg_list_entry e = {.name = b->node.name,
                            .name_len = b->node.name_len,
                            .n_items = b->n_items,
                            .bytes = b->bytes,
                            .version = b->version};
    return put_entry_of(p, &e);
}

/* A stream's LIST entry: n_items = entries kept, bytes = record bytes, version = last id. */
static void stream_entry(const tsd_stream *st, ts__msg_list_entry *e)
{
    e->name = st->node.name;
    e->name_len = st->node.name_len;
    e->n_items = tsd_stream_n_entries(st);
    e->bytes = st->bytes;
    e->version = st->last_id;
}

/* The streams' and tables' entries of a small LIST. */
typedef struct list_ext {
    ts__msg_list_entry *e;
    size_t n;
} list_ext;

static int list_ext_table(tsd_table *t, void *arg)
{
    list_ext *x = arg;
    tsd_table_list_entry(t, &x->e[x->n++]);
    return 0;
}

static int ext_cmp(const void *pa, const void *pb)
{
    const ts__msg_list_entry *a = pa, *b = pb;
    return tsd_name_cmp(a->name, a->name_len, b->name, b->name_len);
}

/* A small LIST: sorted and encoded right away, on the loop. */
static void list_inline(tsd_conn *c, const ts__hdr *h)
{
    tsd_server *srv = c->srv;
    tsd_bin **bins;
    size_t n;
    tsd_stream **sts = NULL;
    size_t ns = 0;
    if (tsd_store_sorted(&srv->store, &bins, &n) != 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory listing bins");
        return;
    }
    /* Streams and replay tables: one array of entries sorted by name, merged with the bins. */
    size_t nt = tsd_table_count(srv);
    ts__msg_list_entry *ext = NULL;
    if (tsd_stream_sorted(srv, &sts, &ns) != 0 ||
        (ns + nt > 0 && (ext = ts__calloc(ns + nt, sizeof(*ext))) == NULL)) {
        ts__free(sts);
        ts__free(bins);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory listing bins");
        return;
    }
    for (size_t i = 0; i < ns; i++)
        stream_entry(sts[i], &ext[i]);
    ts__free(sts);
    sts = NULL;
    list_ext ctx = {ext, ns};
    (void)tsd_table_each(srv, list_ext_table, &ctx);
    ns = ctx.n;
    if (ns > 1)
        qsort(ext, ns, sizeof(*ext), ext_cmp);
    uint64_t body_len = TS_MSG_LIST_FIXED;
    for (size_t i = 0; i < n; i++)
        body_len += ts__msg_list_entry_size(bins[i]->node.name_len);
    for (size_t i = 0; i < ns; i++)
        body_len += ts__msg_list_entry_size(ext[i].name_len);
    if (tsd_out_begin(c, h->opcode, h->request_id) == 0 &&
        tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) == 0) {
        uint8_t *p = tsd_out_bytes(c, (size_t)body_len);
        size_t hlen;
        if (p != NULL &&
            ts__msg_list_head_encode(p, (size_t)body_len, (uint32_t)(n + ns), &hlen) == 0) {
            p += hlen;
            /* Bins, streams and tables share one namespace: merge the two sorted lists. */
            size_t i = 0, k = 0;
            while (i < n || k < ns) {
                if (k == ns || (i < n && tsd_name_cmp(bins[i]->node.name, bins[i]->node.name_len,
                                                      ext[k].name, ext[k].name_len) < 0))
                    p = put_entry(p, bins[i++]);
                else
                    p = put_entry_of(p, &ext[k++]);
            }
        }
    }
    ts__free(ext);
    ts__free(bins);
}

/*
 * A large LIST. Its view of the store (view.c) is taken when the request is handled: the
 * connection's later requests take effect after it, other clients' requests go on between the
 * chunks of its walk, and it still shows every bin as it was at that moment. Each bin's entry is
 * copied in wire form into chunks as the walk (or a change ahead of it) hands the bin over.
 * Once the walk is over, a thread-pool worker sorts the entries by name and writes the body
 * into an item buffer; back on the loop, that buffer is queued as the reply without a copy. The
 * connection is held from the start (tsd_conn_hold): its later requests wait in its input
 * buffer, so the LIST's reply comes before theirs, and a close does not free it before the job
 * ends, which releases it (a close meanwhile ends the walk at the next bin). The job holds
 * nothing of the store. Every buffer counts against --max-memory while the job lives.
 */
/*
 * Bytes of entries per chunk. Chunks never move (the sort points at the entries in place, so
 * nothing is copied as the list grows), and a fresh chunk costs the loop at most 64 page faults.
 */
#define TSD_LIST_CHUNK ((size_t)256 << 10)

typedef struct list_chunk {
    struct list_chunk *next;
    size_t used;
    uint8_t data[];
} list_chunk;

struct tsd_list_job {
    tsd_pass pass; /* first: the view being walked */
    uv_work_t req;
    tsd_server *srv;
    tsd_conn *c; /* held while the job lives (when held is set) */
    int held;
    uint32_t rid;
    size_t n, cap_n;    /* entries copied; the bins of the view */
    list_chunk *chunks; /* the entries, newest chunk first */
    size_t ents_len;    /* bytes of entries in all */
    tsd_item *order;    /* cap_n pointers to the entries (the worker sorts them) */
    tsd_item *body; /* the reply body (worker); body_len bytes, its item length a multiple of 64 */
    size_t body_len;
    uint64_t cost; /* bytes reserved in the store */
};

static void list_job_free(tsd_server *srv, tsd_list_job *j)
{
    tsd_store_unreserve(&srv->store, j->cost);
    while (j->chunks != NULL) {
        list_chunk *k = j->chunks;
        j->chunks = k->next;
        ts__free(k);
    }
    tsd_item_unref(j->order);
    tsd_item_unref(j->body);
    ts__free(j);
}

/* Reserve more bytes for j against --max-memory. 0 or TS_EOOM. */
static int list_reserve(tsd_server *srv, tsd_list_job *j, uint64_t more)
{
    if (tsd_store_reserve(&srv->store, more) != 0)
        return TS_EOOM;
    j->cost += more;
    return 0;
}

/* Thread pool: sort the entries and write the body. Touches only the job's own buffers. */
static void list_work(uv_work_t *req)
{
    tsd_list_job *j = req->data;
    const uint8_t **ptrs = (const uint8_t **)(void *)tsd_item_data(j->order);
    qsort(ptrs, j->n, sizeof(*ptrs), ent_cmp);
    uint8_t *p = tsd_item_data(j->body);
    size_t hlen = 0;
    (void)ts__msg_list_head_encode(p, j->body_len, (uint32_t)j->n, &hlen);
    p += hlen;
    /* The entries were encoded on the loop (put_entry); only their order changes here. */
    for (size_t i = 0; i < j->n; i++) {
        size_t len = ts__msg_list_entry_size(ptrs[i][0]);
        memcpy(p, ptrs[i], len);
        p += len;
    }
    /* Freed here, off the loop: returning tens of megabytes to the system takes milliseconds. */
    while (j->chunks != NULL) {
        list_chunk *k = j->chunks;
        j->chunks = k->next;
        ts__free(k);
    }
}

/*
 * Loop thread: the body is ready. It goes out as the item (its length a multiple of 64, so no
 * padding follows) and the last few bytes after it; a closed connection takes no output.
 */
static void list_reply(tsd_list_job *j, int status)
{
    tsd_conn *c = j->c;
    size_t whole = j->body_len / TS__ALIGN * TS__ALIGN, tail = j->body_len - whole;
    if (status != 0) {
        tsd_reply_err(c, TS_OP_LIST, j->rid, TS_ST_INTERNAL, "listing bins was canceled");
    } else if (tsd_out_begin(c, TS_OP_LIST, j->rid) == 0 &&
               tsd_out_hdr(c, TS_OP_LIST, j->rid, TS_ST_OK, j->body_len) == 0) {
        const uint8_t *data = tsd_item_data(j->body);
        tsd_item_set_len(j->body, whole);
        if (tsd_out_item(c, j->body, 1) == 0 && tail > 0) {
            uint8_t *p = tsd_out_bytes(c, tail);
            if (p != NULL)
                memcpy(p, data + whole, tail);
        }
    }
}

/* Free the job and let its connection go on with the requests queued behind the LIST. */
static void list_end(tsd_server *srv, tsd_list_job *j)
{
    tsd_conn *c = j->c;
    int held = j->held;
    list_job_free(srv, j);
    if (!held)
        return;          /* still inside the LIST's own dispatch, which flushes */
    tsd_conn_release(c); /* may free c */
    tsd_server_flush(srv);
}

/* Loop thread: the worker is done: answer, then end the job. */
static void list_done(uv_work_t *req, int status)
{
    tsd_list_job *j = req->data;
    list_reply(j, status);
    list_end(j->srv, j);
}

/*
 * The view's emit (view.c, or a change ahead of the walk): copy bin's entry into the job. 0;
 * TS_ECANCELED when the connection is closing (nobody would read the reply); TS_EOOM when a new
 * chunk would pass --max-memory; TS_ENOMEM.
 */
static int list_add(tsd_list_job *j, const ts__msg_list_entry *e)
{
    if (j->c->closing)
        return TS_ECANCELED;
    if (j->n == j->cap_n)
        return TS_ENOMEM; /* cannot happen: the view holds exactly the bins counted at its start */
    size_t need = ts__msg_list_entry_size(e->name_len);
    list_chunk *k = j->chunks;
    if (k == NULL || TSD_LIST_CHUNK - k->used < need) {
        if (list_reserve(j->srv, j, sizeof(*k) + TSD_LIST_CHUNK) != 0)
            return TS_EOOM;
        k = ts__malloc(sizeof(*k) + TSD_LIST_CHUNK);
        if (k == NULL)
            return TS_ENOMEM;
        k->used = 0;
        k->next = j->chunks;
        j->chunks = k;
    }
    const uint8_t **ptrs = (const uint8_t **)(void *)tsd_item_data(j->order);
    ptrs[j->n++] = k->data + k->used;
    k->used = (size_t)(put_entry_of(k->data + k->used, e) - k->data);
    j->ents_len += need;
    return 0;
}

static int list_emit(tsd_pass *p, const tsd_bin *b)
{
    ts__msg_list_entry e = {.name = b->node.name,
                            .name_len = b->node.name_len,
                            .n_items = b->n_items,
                            .bytes = b->bytes,
                            .version = b->version};
    return list_add((tsd_list_job *)(void *)p, &e);
}

/* A replay table's entry, copied as the streams' are. */
static int list_add_table(tsd_table *t, void *arg)
{
    ts__msg_list_entry e;
    tsd_table_list_entry(t, &e);
    return list_add(arg, &e);
}

/* The streams' entries, copied when the LIST is handled (the moment its view shows). */
static int list_add_stream(tsd_stream *st, void *arg)
{
    ts__msg_list_entry e;
    stream_entry(st, &e);
    return list_add(arg, &e);
}

/*
 * The view is complete (status 0) or ended early: hand the sort to the thread pool, or answer
 * the error. j->held tells whether the connection is held already (a walk over several turns).
 */
static void list_walked(tsd_list_job *j, int status)
{
    tsd_server *srv = j->srv;
    tsd_conn *c = j->c;
    if (status == 0 && c->closing)
        status = TS_ECANCELED;
    if (status == 0) {
        j->body_len = TS_MSG_LIST_FIXED + j->ents_len;
        size_t cap = ts__align_up(j->body_len, TS__ALIGN);
        status = list_reserve(srv, j, cap);
        if (status == 0) {
            j->body = tsd_item_new_sized(cap);
            if (j->body == NULL)
                status = TS_ENOMEM;
        }
    }
    if (status == TS_EOOM) {
        srv->stats.oom_rejections++;
        tsd_reply_err(c, TS_OP_LIST, j->rid, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory) listing bins");
    } else if (status == TS_ENOMEM) {
        srv->stats.out_of_memory++;
        tsd_reply_err(c, TS_OP_LIST, j->rid, TS_ST_INTERNAL, "out of memory listing bins");
    } else if (status != 0) {
        /* The connection is closing, or tensord is stopping (the request was answered). */
        tsd_reply_err(c, TS_OP_LIST, j->rid, TS_ST_INTERNAL, "listing bins was canceled");
    }
    if (status != 0) {
        list_end(srv, j);
        return;
    }
    j->req.data = j;
    if (uv_queue_work(srv->loop, &j->req, list_work, list_done) != 0) {
        /* No thread pool: do the work here, late rather than never. */
        list_work(&j->req);
        list_reply(j, 0);
        list_end(srv, j);
        return;
    }
    if (!j->held) {
        j->held = 1;
        tsd_conn_hold(c, TS_OP_LIST, j->rid);
    }
}

/* The view's done (view.c): its walk over several loop turns is over. */
static void list_view_done(tsd_pass *p, int status)
{
    list_walked((tsd_list_job *)(void *)p, status);
}

static void op_list(tsd_conn *c, const ts__hdr *h)
{
    tsd_server *srv = c->srv;
    size_t n_streams = srv->streams != NULL ? srv->streams->table.count : 0;
    size_t count = srv->store.bins.count + n_streams + tsd_table_count(srv);
    if (count < TSD_LIST_OFFLOOP_MIN) {
        list_inline(c, h);
        return;
    }
    tsd_list_job *j = ts__calloc(1, sizeof(*j));
    if (j != NULL) {
        j->srv = srv;
        j->c = c;
        j->rid = h->request_id;
        j->cap_n = count;
    }
    int rc = j == NULL ? TS_ENOMEM : list_reserve(srv, j, count * sizeof(uint8_t *));
    if (rc == 0) {
        j->order = tsd_item_new(count * sizeof(uint8_t *));
        if (j->order == NULL)
            rc = TS_ENOMEM;
    }
    if (rc != 0) {
        if (j != NULL)
            list_job_free(srv, j);
        if (rc == TS_EOOM) {
            srv->stats.oom_rejections++;
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                          "memory limit reached (--max-memory) listing bins");
        } else {
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL,
                          "out of memory listing bins");
        }
        return;
    }
    /* j->cap_n counts the streams and tables: the view then brings exactly the bins of now. */
    rc = tsd_stream_each(srv, list_add_stream, j);
    if (rc == 0)
        rc = tsd_table_each(srv, list_add_table, j);
    if (rc != 0) {
        list_walked(j, rc);
        return;
    }
    srv->stats.lists_offloop++;
    j->pass.emit = list_emit;
    j->pass.done = list_view_done;
    if (tsd_view_start(srv, &j->pass) == 0) {
        /* Walked over the next loop turns: the connection waits for it. */
        j->held = 1;
        tsd_conn_hold(c, h->opcode, h->request_id);
        return;
    }
    list_walked(j, j->pass.err);
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
    tsd_stream *st = bin == NULL ? tsd_stream_find(srv, name, nl) : NULL;
    if (st != NULL)
        tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, st->last_id,
                        tsd_stream_n_entries(st));
    else
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
    /* A replay table's inserts wake nobody: WAIT on its name would only time out. */
    if (tsd_table_refuse_name(c, h->opcode, h->request_id, name, nl))
        return;
    /*
     * The rule, here as on every later change (notify.c): the bin exists and its version is
     * above after. A missing bin (never made, emptied by GET, deleted) has version 0 and never
     * satisfies a waiter, so a removal cannot wake anybody into finding nothing.
     */
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    uint64_t version = bin != NULL ? bin->version : 0;
    uint32_t n = bin != NULL ? bin->n_items : 0;
    /* A stream's version is its last id, its n_items the entries it keeps. */
    tsd_stream *st = bin == NULL ? tsd_stream_find(srv, name, nl) : NULL;
    if (st != NULL) {
        version = st->last_id;
        n = tsd_stream_n_entries(st);
    }
    if ((bin != NULL || st != NULL) && version > after) {
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

/* ---------------------------------------------------------------------------------------------
 * By reference (unix connections with HELLO FDS): GET_REF, PEEK_REF, PUT_FD, APPEND_FD
 */

/*
 * GET_REF (remove = 1) and PEEK_REF: as GET and PEEK, at most TS_MAX_REF_ITEMS items, each in a
 * REF_ITEMS entry: by descriptor when it lives in a memfd or a data-dir file, else inline.
 */
static void op_get_ref(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                       uint32_t max_items, int remove)
{
    tsd_server *srv = c->srv;
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    if (bin == NULL) {
        reply_not_found(c, h, "no such bin", name, nl);
        return;
    }
    int live = tsd_bin_is_tensor(bin);
    if (remove && live) {
        reply_tensor_bin(c, h, name, nl);
        return;
    }
    /* The reply starts a batch of its own, so its descriptors go with its first byte. */
    tsd_out_cut(c);
    if (tsd_out_begin(c, h->opcode, h->request_id) != 0)
        return;
    uint32_t n = bin->n_items;
    uint32_t cap = max_items == 0 || max_items > TS_MAX_REF_ITEMS ? TS_MAX_REF_ITEMS : max_items;
    if (n > cap)
        n = cap;
    ts__msg_ref_entry e[TS_MAX_REF_ITEMS];
    int fds[TS_MAX_REF_ITEMS];
    int owned[TS_MAX_REF_ITEMS];
    uint32_t nfds = 0;
    tsd_item *it = bin->head;
    for (uint32_t i = 0; i < n; i++, it = it->next) {
        memset(&e[i], 0, sizeof(e[i]));
        e[i].length = tsd_item_len(it);
        e[i].flags = live ? TS_REF_LIVE : 0;
        if (tsd_shm_ref(it, &fds[nfds], &owned[nfds], &e[i].offset, &e[i].file_len)) {
            e[i].where = TS_REF_FD;
            nfds++;
        } else {
            e[i].where = TS_REF_INLINE;
        }
    }
    uint64_t version = remove ? srv->version + 1 : bin->version;
    uint32_t remaining = bin->n_items - (remove ? n : 0);
    uint64_t body_len = 0;
    uint32_t attached = 0;
    (void)ts__msg_ref_size(n, e, &body_len);
    size_t head = (size_t)ts__msg_ref_head_size(n);
    uint8_t *p = NULL;
    if (tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) == 0)
        p = tsd_out_bytes(c, head);
    size_t hlen;
    if (p == NULL || ts__msg_ref_head_encode(p, head, version, remaining, n, e, &hlen) != 0)
        goto fail;
    for (; attached < nfds; attached++)
        if (tsd_out_fd(c, fds[attached], owned[attached]) != 0) {
            attached++; /* tsd_out_fd closed it */
            goto fail;
        }
    /*
     * The reply holds its own references: inline records by their bytes, the others so that a
     * descriptor the item owns stays open until it is sent.
     */
    it = bin->head;
    for (uint32_t i = 0; i < n && it != NULL; i++, it = it->next) {
        int rc = e[i].where == TS_REF_INLINE ? tsd_out_item(c, it, 1) : tsd_out_hold(c, it);
        if (rc != 0)
            return;
    }
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
    return;
fail:
    /* The reply was taken back (out of memory): close the descriptors not yet attached. */
    for (uint32_t i = attached; i < nfds; i++)
        if (owned[i])
            (void)close(fds[i]);
}

/*
 * PUT_FD (replace) and APPEND_FD: the record is bytes [0, rec_len) of the memfd that came with
 * the frame (c->claimed_fd). It is sealed, counted, mapped read-only, validated and stored
 * without a copy.
 */
static void op_put_fd(tsd_conn *c, const ts__hdr *h, const ts__msg_put_fd_req *m)
{
    tsd_server *srv = c->srv;
    int fd = c->claimed_fd;
    c->claimed_fd = -1;
    if (tsd_writes_refused(srv)) {
        (void)close(fd);
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    if (m->rec_len < TS_REC_HDR_SIZE) {
        (void)close(fd);
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_RECORD,
                      "record of %llu bytes is shorter than a record header (%d bytes)",
                      (unsigned long long)m->rec_len, TS_REC_HDR_SIZE);
        return;
    }
    tsd_item *it = NULL;
    int rc = tsd_shm_adopt(srv, fd, m->rec_len, &it);
    if (rc != 0) {
        (void)close(fd);
        if (rc == -EBUSY)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                          "shared buffer is still mapped writable");
        else if (rc == -EFBIG)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                          "shared buffer's file is larger than 2^46 bytes (the most tensord "
                          "maps)");
        else if (rc == -ERANGE)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                          "record_len %llu is 0 or past the end of the shared buffer",
                          (unsigned long long)m->rec_len);
        else if (rc == TS_ENOMEM)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                          "tensord is out of memory mapping the shared buffer");
        else
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                          "descriptor is not a sealable memfd");
        return;
    }
    /* The whole file counts (rounded up to pages), as the server's own buffer would. */
    uint64_t cost = ((tsd_item_own *)(void *)it)->alloc_len;
    if (tsd_store_reserve(&srv->store, cost) != 0) {
        tsd_item_unref(it);
        srv->stats.oom_rejections++;
        const tsd_store *st = &srv->store;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached: %llu of %llu bytes used; the shared buffer needs "
                      "%llu more",
                      (unsigned long long)tsd_store_used(st), (unsigned long long)st->max_memory,
                      (unsigned long long)cost);
        return;
    }
    size_t len = tsd_item_len(it);
    if (ts__record_validate(tsd_item_data(it), len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) != 0) {
        tsd_store_unreserve(&srv->store, cost);
        tsd_item_unref(it);
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_BAD_RECORD,
                      "the %zu-byte record failed validation", len);
        return;
    }
    /* The store takes the record's reservation; the rest of the file counts as overhead. */
    tsd_store_unreserve(&srv->store, cost - len);
    /*
     * With --data-dir the record goes to a file like an upload's, so that it survives a restart:
     * one copy within this host (never through the socket), made once the record is sealed and
     * valid. A refusal by --max-disk answers as a PUT's does, and keeps the connection.
     */
    tsd_item *file = NULL;
    int drc = tsd_datadir_alloc(srv, len, &file);
    if (drc < 0) {
        char dmsg[TS_MAX_ERRMSG];
        tsd_datadir_refusal(srv, drc, len, dmsg, sizeof(dmsg));
        tsd_store_unreserve(&srv->store, len);
        tsd_item_unref(it);
        srv->stats.oom_rejections++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY, "%s", dmsg);
        return;
    }
    if (drc == 0) {
        memcpy(tsd_item_data(file), tsd_item_data(it), len);
        tsd_item_unref(it);
        it = file;
    }
    srv->stats.ops[h->opcode]--; /* tsd_op_store counts it again */
    tsd_op_store(c, h, m->name, m->name_len, it);
}

void tsd_op_dispatch(tsd_conn *c, const ts__hdr *h, const uint8_t *body, size_t len)
{
    tsd_server *srv = c->srv;
    srv->stats.ops[h->opcode]++;
    /* GET and DELETE remove items: refused like PUT/APPEND while snapshots fail. */
    if ((h->opcode == TS_OP_GET || h->opcode == TS_OP_DELETE || h->opcode == TS_OP_TENSOR_BIN ||
         h->opcode == TS_OP_GET_REF) &&
        tsd_writes_refused(srv)) {
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    /* The codec's strict decoder of this opcode's request (its table picks which). */
    ts__msg m;
    int rc = ts__msg_request_decode(h->opcode, body, len, &m);
    if (rc == TS_EUNKNOWNOP || (rc == 0 && m.kind == TS_MSG_PUT_REQ)) {
        /* ts__msg_request_check admits only request opcodes; PUT/APPEND never come here. */
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x",
                      h->opcode);
        return;
    }
    if (rc != 0) {
        malformed(c, h);
        return;
    }
    /* A sharded daemon serves only the names it owns (shard.c; MGET: every one of them). */
    if (tsd_shard_refuse_request(c, h, &m, body, len))
        return; /* a descriptor that came with the frame is closed by conn.c */
    const ts__msg_name_req *q = &m.u.name_req;
    /* The plain-bin requests refuse a stream's name (INVALID; the connection stays). */
    const uint8_t *bname = NULL;
    size_t blen = 0;
    if (m.kind == TS_MSG_GET_REQ) {
        bname = q->name;
        blen = q->name_len;
    } else if (m.kind == TS_MSG_PUT_FD_REQ) {
        bname = m.u.put_fd.name;
        blen = m.u.put_fd.name_len;
    } else if (m.kind == TS_MSG_TENSOR_BIN_REQ) {
        bname = m.u.tensor_bin.name;
        blen = m.u.tensor_bin.name_len;
    } else if (m.kind == TS_MSG_READ_ROWS_REQ) {
        bname = m.u.read_rows.name;
        blen = m.u.read_rows.name_len;
    } else if (m.kind == TS_MSG_ADD_REQ || m.kind == TS_MSG_TAKE_REQ) {
        bname = m.u.coord.name;
        blen = m.u.coord.name_len;
    }
    if (bname != NULL && tsd_stream_refuse_name(c, h->opcode, h->request_id, bname, blen))
        return; /* a descriptor that came with the frame is closed by conn.c */
    /* Those and the stream requests refuse a replay table's name (INVALID) too. */
    if (m.kind == TS_MSG_STREAM_CREATE_REQ) {
        bname = m.u.stream_create.name;
        blen = m.u.stream_create.name_len;
    } else if (m.kind == TS_MSG_STREAM_MARK_REQ) {
        bname = m.u.stream_mark.name;
        blen = m.u.stream_mark.name_len;
    } else if (m.kind == TS_MSG_STREAM_CREDIT_REQ) {
        bname = m.u.stream_credit.name;
        blen = m.u.stream_credit.name_len;
    } else if (m.kind == TS_MSG_STREAM_JOIN_REQ || m.kind == TS_MSG_STREAM_READ_REQ ||
               m.kind == TS_MSG_STREAM_ACK_REQ || m.kind == TS_MSG_STREAM_LEAVE_REQ) {
        bname = m.u.stream_member.name;
        blen = m.u.stream_member.name_len;
    } else if (m.kind == TS_MSG_STREAM_RANGE_REQ) {
        bname = m.u.stream_range.name;
        blen = m.u.stream_range.name_len;
    } else if (h->opcode == TS_OP_STREAM_INFO) {
        bname = q->name;
        blen = q->name_len;
    }
    if (bname != NULL && tsd_table_refuse_name(c, h->opcode, h->request_id, bname, blen))
        return;
    switch (h->opcode) {
    case TS_OP_HELLO:
        op_hello(c, h, &m.u.hello_req);
        return;
    case TS_OP_AUTH_CHALLENGE:
        op_auth_challenge(c, h, &m.u.auth_nonce);
        return;
    case TS_OP_PING:
        tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, NULL, 0);
        return;
    case TS_OP_LIST:
        op_list(c, h);
        return;
    case TS_OP_STATS:
        tsd_stats_reply(c, h);
        return;
    case TS_OP_SHARD_MAP:
        tsd_shard_map_reply(c, h);
        return;
    case TS_OP_SAVE:
        if (srv->cfg.save_path == NULL)
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID, "snapshots not configured");
        else
            tsd_snapshot_request(srv, c, h->request_id);
        return;
    case TS_OP_GET:
    case TS_OP_PEEK:
        op_get(c, h, q->name, q->name_len, q->max_items, h->opcode == TS_OP_GET);
        return;
    case TS_OP_DELETE:
        op_delete(c, h, q->name, q->name_len);
        return;
    case TS_OP_LISTEN:
        op_listen(c, h, q->name, q->name_len);
        return;
    case TS_OP_UNLISTEN:
        op_unlisten(c, h, q->name, q->name_len);
        return;
    case TS_OP_WAIT:
        op_wait(c, h, q->name, q->name_len, q->after_version, q->timeout_ms);
        return;
    case TS_OP_GET_REF:
    case TS_OP_PEEK_REF:
        op_get_ref(c, h, q->name, q->name_len, q->max_items, h->opcode == TS_OP_GET_REF);
        return;
    case TS_OP_PUT_FD:
    case TS_OP_APPEND_FD:
        op_put_fd(c, h, &m.u.put_fd);
        return;
    case TS_OP_TENSOR_BIN:
    case TS_OP_READ_ROWS:
        tsd_rows_dispatch(c, h, &m); /* rows.c */
        return;
    case TS_OP_STREAM_CREATE:
    case TS_OP_STREAM_MARK:
    case TS_OP_STREAM_CREDIT:
    case TS_OP_STREAM_JOIN:
    case TS_OP_STREAM_READ:
    case TS_OP_STREAM_ACK:
    case TS_OP_STREAM_LEAVE:
    case TS_OP_STREAM_INFO:
    case TS_OP_STREAM_RANGE:
        tsd_stream_dispatch(c, h, &m); /* stream.c */
        return;
    case TS_OP_ADD:
    case TS_OP_TAKE:
    case TS_OP_MGET:
    case TS_OP_BARRIER:
        tsd_coord_dispatch(c, h, &m); /* coord.c */
        return;
    case TS_OP_TABLE_CREATE:
    case TS_OP_TABLE_SAMPLE:
    case TS_OP_TABLE_UPDATE:
    case TS_OP_TABLE_REMOVE:
    case TS_OP_TABLE_INFO:
        tsd_table_dispatch(c, h, &m); /* table.c */
        return;
    case TS_OP_PS_CREATE:
    case TS_OP_PS_PULL:
    case TS_OP_EMB_CREATE:
        tsd_ps_dispatch(c, h, &m); /* ps.c */
        return;
    case TS_OP_SVC_REGISTER:
        tsd_svc_dispatch(c, h, &m); /* service.c */
        return;
    default:
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x",
                      h->opcode);
        return;
    }
}
