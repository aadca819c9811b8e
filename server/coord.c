/*
 * Coordination primitives (coord.h). A counter is a plain bin holding one item whose record's
 * root is an int, so PEEK, GET, WAIT, LISTEN and snapshots treat it like any other bin; ADD
 * replaces that item with a new 64-byte record. PUT_IF is a PUT decided by the bin's version.
 * Every change takes a version from the server's change counter and notifies like a PUT.
 */
#include "coord.h"

#include "msg.h"
#include "record.h"
#include "stream.h"
#include "table.h"

/* Room for a printable bin name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define TSD_COORD_NAME_CAP (TS_MAX_NAME_LEN * 4 + 1)
/* bytes of an int root's meta: the type byte and the i64 */
#define TSD_COUNTER_META 9
/* bytes of a counter's record: the header and meta, padded to the data area (no data) */
#define TSD_COUNTER_REC 64
_Static_assert(TSD_COUNTER_REC == (TS_REC_HDR_SIZE + TSD_COUNTER_META + 63) / 64 * 64,
               "a counter record is its header and meta padded to 64 bytes");

/*
 * The value of a counter bin: 0 and *v when bin holds exactly one item whose record's root is
 * an int (stored records have been validated, so the header can be trusted); -1 otherwise.
 */
static int counter_value(const tsd_bin *bin, int64_t *v)
{
    if (bin->n_items != 1)
        return -1;
    const tsd_item *it = bin->head;
    const uint8_t *p = tsd_item_data(it);
    if (tsd_item_len(it) < TS_REC_HDR_SIZE + TSD_COUNTER_META)
        return -1;
    if (ts__get_u32le(p + 4) != TSD_COUNTER_META || p[TS_REC_HDR_SIZE] != TS_TYPE_INT)
        return -1;
    *v = (int64_t)ts__get_u64le(p + TS_REC_HDR_SIZE + 1);
    return 0;
}

/* Write a counter's canonical record (docs/PROTOCOL.md 10.4) for value v into p. */
static void counter_write(uint8_t *p, int64_t v)
{
    memset(p, 0, TSD_COUNTER_REC);
    p[0] = TS_REC_MAGIC0;
    p[1] = TS_REC_MAGIC1;
    p[2] = TS_REC_MAGIC2;
    p[3] = TS_REC_MAGIC3;
    ts__put_u32le(p + 4, TSD_COUNTER_META);
    ts__put_u64le(p + 8, 0);
    p[TS_REC_HDR_SIZE] = TS_TYPE_INT;
    ts__put_u64le(p + TS_REC_HDR_SIZE + 1, (uint64_t)v);
}

/*
 * ADD: the counter's value plus delta, stored as the bin's only item (a missing bin starts at
 * 0). A bin that is not a counter, and a sum past int64, are INVALID and change nothing.
 */
static void op_add(tsd_conn *c, const ts__hdr *h, const ts__msg_coord_req *q)
{
    tsd_server *srv = c->srv;
    char pn[TSD_COORD_NAME_CAP];
    if (tsd_writes_refused(srv)) {
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    int64_t cur = 0, next;
    tsd_bin *bin = tsd_store_find(&srv->store, q->name, q->name_len);
    if (bin != NULL && counter_value(bin, &cur) != 0) {
        tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "ADD on bin '%s': not a counter (a counter holds one item whose record is an "
                      "int; this bin holds %u items)",
                      pn, bin->n_items);
        return;
    }
    if (__builtin_add_overflow(cur, q->delta, &next)) {
        tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "ADD of %lld to counter '%s' (%lld) overflows int64", (long long)q->delta, pn,
                      (long long)cur);
        return;
    }
    /*
     * With --data-dir the new item goes to a file as a PUT's record does (at least --data-min
     * bytes), so that the counter survives a restart; a refusal answers as a PUT's does. Its
     * pages count against --max-disk, not --max-memory, but tsd_store_add consumes a
     * reservation of its length: one is made without a check.
     */
    tsd_item *it = NULL;
    int drc = tsd_datadir_alloc(srv, TSD_COUNTER_REC, &it);
    if (drc < 0) {
        char dmsg[TS_MAX_ERRMSG];
        tsd_datadir_refusal(srv, drc, TSD_COUNTER_REC, dmsg, sizeof(dmsg));
        srv->stats.oom_rejections++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY, "%s", dmsg);
        return;
    }
    if (drc == 0) {
        srv->store.reserved += TSD_COUNTER_REC;
    } else if (tsd_store_reserve(&srv->store, TSD_COUNTER_REC) != 0) {
        srv->stats.oom_rejections++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory) adding to a counter");
        return;
    } else if ((it = tsd_item_new(TSD_COUNTER_REC)) == NULL) {
        tsd_store_unreserve(&srv->store, TSD_COUNTER_REC);
        srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: a counter's item could not be allocated");
        return;
    }
    counter_write(tsd_item_data(it), next);
    uint64_t version = tsd_server_next_version(srv);
    /* tsd_store_add takes over the reservation (and replaces the old item). */
    if (tsd_store_add(&srv->store, q->name, q->name_len, it, 1, version) == NULL) {
        tsd_store_unreserve(&srv->store, TSD_COUNTER_REC);
        tsd_item_unref(it);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory adding a bin");
        return;
    }
    /* An item in a data-dir file gets its header now, as a PUT's does. */
    (void)tsd_datadir_commit(srv, it, q->name, q->name_len, TSD_DATADIR_REPLACE);
    ts__msg_add_state st = {.value = next, .version = version};
    uint8_t body[TS_MSG_ADD_STATE_SIZE];
    size_t len;
    (void)ts__msg_add_state_encode(body, sizeof(body), &st, &len);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, len);
    tsd_notify_change(srv, q->name, q->name_len, version, 1, TS_NOTE_PUT);
}

void tsd_coord_put_if(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                      const uint8_t *fixed, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint64_t expected = ts__get_u64le(fixed);
    srv->stats.ops[h->opcode]++;
    if (tsd_stream_refuse_name(c, h->opcode, h->request_id, name, name_len)) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        return;
    }
    tsd_bin *bin = tsd_store_find(&srv->store, name, name_len);
    if (tsd_bin_is_tensor(bin)) {
        char pn[TSD_COORD_NAME_CAP];
        tsd_name_printable(name, name_len, pn, sizeof(pn));
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "PUT_IF on tensor bin %s: its rows are written with WRITE_ROWS", pn);
        return;
    }
    /* A missing bin has version 0, so expected 0 means "only if it does not exist". */
    uint64_t cur = bin != NULL ? bin->version : 0;
    if (cur != expected) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_reply_state(c, h->opcode, h->request_id, TS_ST_VERSION_MISMATCH, cur,
                        bin != NULL ? bin->n_items : 0);
        return;
    }
    uint64_t version = tsd_server_next_version(srv);
    bin = tsd_store_add(&srv->store, name, name_len, item, 1, version);
    if (bin == NULL) {
        tsd_store_unreserve(&srv->store, tsd_item_len(item));
        tsd_item_unref(item);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL, "out of memory adding a bin");
        return;
    }
    /* An item in a data-dir file gets its header now, as a PUT's does. */
    (void)tsd_datadir_commit(srv, item, name, name_len, TSD_DATADIR_REPLACE);
    tsd_reply_state(c, h->opcode, h->request_id, TS_ST_OK, version, bin->n_items);
    tsd_notify_change(srv, name, name_len, version, bin->n_items, TS_NOTE_PUT);
}

/* ---------------------------------------------------------------------------------------------
 * Waits: TAKE and BARRIER
 *
 * A pending TAKE or BARRIER arrival is a coord_wait, linked in arrival order into its name's
 * queue (TAKE queues by bin name, barriers by barrier name, in two tables) and into the server's
 * list of all waits, which the housekeeping timer walks for deadlines (tsd_coord_cron, every
 * TSD_CRON_MS). Like a pending WAIT it counts against --max-watch (c->n_watch).
 */

/* Barriers a server keeps at most: each costs a small struct for the server's life. */
#define TSD_MAX_BARRIERS 65536u
/* Parties of one barrier at most: bounds the replies one arrival can release. */
#define TSD_MAX_BARRIER_PARTIES 65536u

typedef struct coord_wait coord_wait;

/* The waits of one name: a bin's takers, or a barrier's arrivals and generation. */
typedef struct coord_queue {
    tsd_hnode node;
    coord_wait *head, *tail;
    uint32_t n;          /* waits queued */
    uint32_t parties;    /* barrier: the parties of the generation being formed */
    uint64_t generation; /* barrier: the last generation released (0: none yet) */
    uint8_t name[];
} coord_queue;

struct coord_wait {
    coord_wait *qprev, *qnext; /* in its queue, arrival order */
    coord_wait *aprev, *anext; /* in the server's list of all waits */
    coord_queue *q;
    tsd_conn *c;
    uint32_t rid;
    uint8_t op;         /* TS_OP_TAKE or TS_OP_BARRIER */
    uint32_t max_items; /* TAKE */
    uint64_t deadline;  /* uv_now ms */
};

struct tsd_coord {
    tsd_htab takes;
    tsd_htab barriers;
    coord_wait *all_head, *all_tail;
    int serving; /* a change is handing items to takers (see tsd_coord_changed) */
};

/* The server's coordination state, made on first use. NULL when it cannot be allocated. */
static struct tsd_coord *coord_of(tsd_server *srv)
{
    if (srv->coord != NULL)
        return srv->coord;
    struct tsd_coord *k = ts__calloc(1, sizeof(*k));
    if (k == NULL)
        return NULL;
    if (tsd_htab_init(&k->takes) != 0 || tsd_htab_init(&k->barriers) != 0) {
        tsd_htab_free(&k->takes);
        ts__free(k);
        return NULL;
    }
    srv->coord = k;
    return k;
}

/*
 * What a queue (a TAKE queue, or a barrier, which stays once used) counts against --max-memory,
 * in store.overhead: its block (struct and name) and its share of the bucket array, which holds
 * up to two pointers per queue (as a bin's).
 */
static uint64_t queue_cost(size_t len)
{
    return tsd_heap_block(sizeof(coord_queue) + len) + 2 * sizeof(tsd_hnode *);
}

/*
 * The queue of name in t, made when make is 1; NULL when missing, or when it could not be made
 * (the memory limit, counted in stats.oom_rejections, or an allocation failure).
 */
static coord_queue *queue_get(tsd_server *srv, tsd_htab *t, const uint8_t *name, size_t len,
                              int make)
{
    tsd_hnode *n = tsd_htab_find(t, name, len);
    if (n != NULL || !make)
        return (coord_queue *)(void *)n;
    if (tsd_store_charge(srv, NULL, queue_cost(len)) != 0)
        return NULL;
    coord_queue *q = ts__calloc(1, sizeof(*q) + len);
    if (q == NULL) {
        tsd_store_uncharge(srv, NULL, queue_cost(len));
        srv->stats.out_of_memory++;
        return NULL;
    }
    memcpy(q->name, name, len);
    q->node.name = q->name;
    q->node.name_len = (uint8_t)len;
    q->node.hash = tsd_hash(name, len);
    tsd_htab_insert(t, &q->node);
    return q;
}

/* Free q (already unlinked) and give back what it counted. */
static void queue_free(tsd_server *srv, coord_queue *q)
{
    tsd_store_uncharge(srv, NULL, queue_cost(q->node.name_len));
    ts__free(q);
}

/* Unlink w from its queue and the server's list, give back its --max-watch place, free it. */
static void wait_drop(tsd_server *srv, coord_wait *w)
{
    struct tsd_coord *k = srv->coord;
    coord_queue *q = w->q;
    if (w->qprev != NULL)
        w->qprev->qnext = w->qnext;
    else
        q->head = w->qnext;
    if (w->qnext != NULL)
        w->qnext->qprev = w->qprev;
    else
        q->tail = w->qprev;
    q->n--;
    if (w->aprev != NULL)
        w->aprev->anext = w->anext;
    else
        k->all_head = w->anext;
    if (w->anext != NULL)
        w->anext->aprev = w->aprev;
    else
        k->all_tail = w->aprev;
    w->c->n_watch--;
    srv->store.conns -= sizeof(*w);
    int take = w->op == TS_OP_TAKE;
    ts__free(w);
    /* A take queue that is empty goes (a barrier stays: it keeps its generation). */
    if (q->n == 0 && take) {
        tsd_htab_remove(&k->takes, &q->node);
        queue_free(srv, q);
    }
}

/*
 * Queue a wait of op for c at the tail of q (made in t for name). 0, or the status to answer
 * (INVALID for --max-watch, OUT_OF_MEMORY) with nothing queued.
 */
static uint16_t wait_add(tsd_conn *c, tsd_htab *t, const uint8_t *name, size_t len, uint8_t op,
                         uint32_t rid, uint32_t max_items, uint32_t timeout_ms, coord_queue **qout)
{
    tsd_server *srv = c->srv;
    struct tsd_coord *k = srv->coord;
    if (c->n_watch >= srv->cfg.max_watch)
        return TS_ST_INVALID;
    if (tsd_store_reserve(&srv->store, sizeof(coord_wait)) != 0)
        return TS_ST_OUT_OF_MEMORY;
    tsd_store_unreserve(&srv->store, sizeof(coord_wait));
    coord_queue *q = queue_get(srv, t, name, len, 1);
    coord_wait *w = q != NULL ? ts__calloc(1, sizeof(*w)) : NULL;
    if (w == NULL) {
        if (q != NULL && q->n == 0 && t == &k->takes) {
            tsd_htab_remove(t, &q->node);
            queue_free(srv, q);
        }
        return TS_ST_OUT_OF_MEMORY;
    }
    if (timeout_ms > TSD_MAX_WAIT_MS)
        timeout_ms = TSD_MAX_WAIT_MS;
    w->q = q;
    w->c = c;
    w->rid = rid;
    w->op = op;
    w->max_items = max_items;
    w->deadline = uv_now(srv->loop) + timeout_ms;
    w->qprev = q->tail;
    if (q->tail != NULL)
        q->tail->qnext = w;
    else
        q->head = w;
    q->tail = w;
    q->n++;
    w->aprev = k->all_tail;
    if (k->all_tail != NULL)
        k->all_tail->anext = w;
    else
        k->all_head = w;
    k->all_tail = w;
    c->n_watch++;
    srv->store.conns += sizeof(*w);
    if (qout != NULL)
        *qout = q;
    return TS_ST_OK;
}

static void reply_wait_status(tsd_conn *c, uint8_t op, uint32_t rid, uint16_t status)
{
    if (status == TS_ST_INVALID)
        tsd_reply_err(c, op, rid, status,
                      "too many subscriptions and pending waits on this connection "
                      "(--max-watch)");
    else
        tsd_reply_err(c, op, rid, status, "memory limit reached (--max-memory) waiting");
}

/* TAKE: the items now when the bin has some and nobody waits before us; else wait in line. */
static void op_take(tsd_conn *c, const ts__hdr *h, const ts__msg_coord_req *q)
{
    tsd_server *srv = c->srv;
    if (tsd_writes_refused(srv)) {
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    tsd_bin *bin = tsd_store_find(&srv->store, q->name, q->name_len);
    if (tsd_bin_is_tensor(bin)) {
        char pn[TSD_COORD_NAME_CAP];
        tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "TAKE on tensor bin %s: its rows are read with PEEK or the row reads", pn);
        return;
    }
    struct tsd_coord *k = coord_of(srv);
    if (k == NULL) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY, "out of memory waiting");
        return;
    }
    /* First come, first served: a TAKE never passes one that waits already. */
    int queued = queue_get(srv, &k->takes, q->name, q->name_len, 0) != NULL;
    if (bin != NULL && bin->n_items > 0 && !queued) {
        (void)tsd_reply_items(c, h->opcode, h->request_id, q->name, q->name_len, bin, q->count, 1);
        return;
    }
    if (q->timeout_ms == 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_TIMEOUT, "no items to take");
        return;
    }
    uint16_t st = wait_add(c, &k->takes, q->name, q->name_len, TS_OP_TAKE, h->request_id, q->count,
                           q->timeout_ms, NULL);
    if (st != TS_ST_OK)
        reply_wait_status(c, h->opcode, h->request_id, st);
}

void tsd_coord_changed(tsd_server *srv, const uint8_t *name, size_t len)
{
    struct tsd_coord *k = srv->coord;
    if (k == NULL || k->serving || k->takes.count == 0)
        return;
    coord_queue *q = queue_get(srv, &k->takes, name, len, 0);
    if (q == NULL)
        return;
    /*
     * Hand the bin's items to the takers in arrival order, each its share, until the bin or the
     * queue runs out. Serving one notifies (GET), which comes back here: serving blocks that.
     */
    k->serving = 1;
    for (;;) {
        tsd_bin *bin = tsd_store_find(&srv->store, name, len);
        q = queue_get(srv, &k->takes, name, len, 0);
        if (bin == NULL || bin->n_items == 0 || q == NULL || tsd_bin_is_tensor(bin))
            break;
        coord_wait *w = q->head;
        tsd_conn *c = w->c;
        uint32_t rid = w->rid, max_items = w->max_items;
        wait_drop(srv, w);
        (void)tsd_reply_items(c, TS_OP_TAKE, rid, name, len, bin, max_items, 1);
    }
    k->serving = 0;
}

/* BARRIER: count the arrival; the last of the parties releases them all. */
static void op_barrier(tsd_conn *c, const ts__hdr *h, const ts__msg_coord_req *q)
{
    tsd_server *srv = c->srv;
    char pn[TSD_COORD_NAME_CAP];
    tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
    if (q->count == 0 || q->count > TSD_MAX_BARRIER_PARTIES) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "BARRIER %s with %u parties: expected 1 to %u", pn, q->count,
                      TSD_MAX_BARRIER_PARTIES);
        return;
    }
    struct tsd_coord *k = coord_of(srv);
    if (k == NULL) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY, "out of memory waiting");
        return;
    }
    coord_queue *b = queue_get(srv, &k->barriers, q->name, q->name_len, 0);
    if (b == NULL && k->barriers.count >= TSD_MAX_BARRIERS) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "BARRIER %s: this server keeps %u barriers already", pn, TSD_MAX_BARRIERS);
        return;
    }
    if (b != NULL && b->n > 0 && b->parties != q->count) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "BARRIER %s with %u parties: the %u waiting came with %u", pn, q->count, b->n,
                      b->parties);
        return;
    }
    uint32_t arrived = (b != NULL ? b->n : 0) + 1;
    if (arrived < q->count) {
        if (q->timeout_ms == 0) {
            tsd_reply_err(c, h->opcode, h->request_id, TS_ST_TIMEOUT,
                          "BARRIER %s: %u of %u parties arrived", pn, arrived, q->count);
            return;
        }
        uint16_t st = wait_add(c, &k->barriers, q->name, q->name_len, TS_OP_BARRIER, h->request_id,
                               0, q->timeout_ms, &b);
        if (st != TS_ST_OK) {
            reply_wait_status(c, h->opcode, h->request_id, st);
            return;
        }
        b->parties = q->count;
        return;
    }
    if (b == NULL && (b = queue_get(srv, &k->barriers, q->name, q->name_len, 1)) == NULL) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "BARRIER %s: memory limit reached (--max-memory) or out of memory keeping "
                      "a new barrier",
                      pn);
        return;
    }
    /* The last arrival: release this generation, the waiters in arrival order, then itself. */
    b->generation++;
    ts__msg_barrier_state bs = {.generation = b->generation, .parties = q->count};
    uint8_t body[TS_MSG_BARRIER_STATE_SIZE];
    size_t len;
    (void)ts__msg_barrier_state_encode(body, sizeof(body), &bs, &len);
    while (b->head != NULL) {
        coord_wait *w = b->head;
        tsd_reply(w->c, TS_OP_BARRIER, w->rid, TS_ST_OK, body, len);
        wait_drop(srv, w);
    }
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, len);
}

void tsd_coord_cron(tsd_server *srv)
{
    struct tsd_coord *k = srv->coord;
    if (k == NULL)
        return;
    uint64_t now = uv_now(srv->loop);
    for (coord_wait *w = k->all_head, *next; w != NULL; w = next) {
        next = w->anext;
        if (w->deadline > now)
            continue;
        if (w->op == TS_OP_TAKE)
            tsd_reply_err(w->c, w->op, w->rid, TS_ST_TIMEOUT, "no items to take in time");
        else
            tsd_reply_err(w->c, w->op, w->rid, TS_ST_TIMEOUT,
                          "barrier: %u of %u parties arrived in time", w->q->n, w->q->parties);
        wait_drop(srv, w); /* a barrier arrival is withdrawn */
    }
}

size_t tsd_coord_conn_drop(tsd_server *srv, tsd_conn *c, int answer)
{
    struct tsd_coord *k = srv->coord;
    size_t n = 0;
    if (k == NULL)
        return 0;
    for (coord_wait *w = k->all_head, *next; w != NULL; w = next) {
        next = w->anext;
        if (w->c != c)
            continue;
        if (answer)
            tsd_reply_msg(c, w->op, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                          sizeof(TSD_SHUTDOWN_MSG) - 1);
        wait_drop(srv, w);
        n++;
    }
    return n;
}

/* Free every queue of t. */
static void free_queues(tsd_server *srv, tsd_htab *t)
{
    for (size_t i = 0; t->buckets != NULL && i <= t->mask; i++) {
        tsd_hnode *n = t->buckets[i];
        while (n != NULL) {
            tsd_hnode *next = n->next;
            queue_free(srv, (coord_queue *)(void *)n);
            n = next;
        }
    }
    tsd_htab_free(t);
}

void tsd_coord_free(tsd_server *srv)
{
    struct tsd_coord *k = srv->coord;
    if (k == NULL)
        return;
    for (coord_wait *w = k->all_head, *next; w != NULL; w = next) {
        next = w->anext;
        ts__free(w);
    }
    free_queues(srv, &k->takes);
    free_queues(srv, &k->barriers);
    ts__free(k);
    srv->coord = NULL;
}

/* ---------------------------------------------------------------------------------------------
 * MGET
 */

/* MGET: PEEK several bins at once; missing bins are reported missing. */
static void op_mget(tsd_conn *c, const ts__hdr *h, const ts__msg_mget_req *q)
{
    tsd_server *srv = c->srv;
    tsd_bin *bins[TS_MGET_MAX_NAMES];
    uint8_t found[TS_MGET_MAX_NAMES];
    uint64_t blens[TS_MGET_MAX_NAMES];
    uint32_t counts[TS_MGET_MAX_NAMES];
    size_t off = 0;
    const uint8_t *name;
    size_t nl;
    uint64_t body_len = ts__msg_mget_head_size(q->n);
    for (uint32_t i = 0; i < q->n && ts__msg_mget_req_next(q, &off, &name, &nl); i++) {
        bins[i] = tsd_store_find(&srv->store, name, nl);
        /*
         * A stream or a replay table is not a missing bin: PEEK of one is INVALID, and so is the
         * whole MGET, naming the first such name (nothing is returned).
         */
        if (bins[i] == NULL && (tsd_stream_refuse_name(c, h->opcode, h->request_id, name, nl) ||
                                tsd_table_refuse_name(c, h->opcode, h->request_id, name, nl)))
            return;
        found[i] = bins[i] != NULL ? TS_MGET_FOUND : TS_MGET_MISSING;
        blens[i] = 0;
        counts[i] = 0;
        if (bins[i] == NULL)
            continue;
        uint32_t n = bins[i]->n_items;
        if (q->max_items != 0 && q->max_items < n)
            n = q->max_items;
        counts[i] = n;
        uint64_t b = ts__items_head_size(n);
        tsd_item *it = bins[i]->head;
        for (uint32_t j = 0; j < n; j++, it = it->next)
            b += tsd_item_len(it) + ts__msg_items_pad(tsd_item_len(it));
        blens[i] = b;
        body_len += b;
    }
    if (tsd_out_begin(c, h->opcode, h->request_id) != 0)
        return;
    if (tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) != 0)
        return;
    size_t head = (size_t)ts__msg_mget_head_size(q->n);
    uint8_t *p = tsd_out_bytes(c, head);
    if (p == NULL)
        return;
    size_t hl;
    (void)ts__msg_mget_head_encode(p, head, q->n, found, blens, &hl);
    for (uint32_t i = 0; i < q->n; i++) {
        if (bins[i] == NULL)
            continue;
        uint32_t n = counts[i];
        size_t ih = (size_t)ts__items_head_size(n);
        uint8_t *ip = tsd_out_bytes(c, ih);
        if (ip == NULL)
            return;
        (void)ts__msg_items_head_encode(ip, ih, bins[i]->version, n, bins[i]->n_items, NULL, &hl);
        tsd_item *it = bins[i]->head;
        for (uint32_t j = 0; j < n; j++, it = it->next)
            ts__msg_items_set_len(ip, j, tsd_item_len(it));
        it = bins[i]->head;
        for (uint32_t j = 0; j < n && it != NULL; j++, it = it->next)
            if (tsd_out_item(c, it, 1) != 0)
                return;
    }
}

void tsd_coord_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    switch (h->opcode) {
    case TS_OP_ADD:
        op_add(c, h, &m->u.coord);
        return;
    case TS_OP_TAKE:
        op_take(c, h, &m->u.coord);
        return;
    case TS_OP_MGET:
        op_mget(c, h, &m->u.mget_req);
        return;
    case TS_OP_BARRIER:
        op_barrier(c, h, &m->u.coord);
        return;
    default:
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x",
                      h->opcode);
        return;
    }
}
