/*
 * Services (service.h). A service is a name with a list of registrations (connections serving
 * it, each with a concurrency: the calls it may hold unanswered) and a queue of calls waiting for
 * room. A call is handed to the registration after the last one used that has room (round
 * robin), as an SVC_REQUEST push that references the request's record (no copy); the server's
 * SVC_REPLY is routed back as the CALL's reply, its record again referenced, not copied.
 *
 * A call lives from its CALL until the server that holds it answers or leaves, or, while it is
 * still queued, until its caller is answered. Its caller may be answered earlier (TIMEOUT, or
 * the caller left): a handed call then stays counted against its server's concurrency until the
 * server answers it, so a server is never handed more calls than it asked for, and its late
 * answer is dropped. Deadlines are kept in a binary heap with one timer for the earliest.
 */
#include "service.h"

#include "msg.h"

/* Room for a printable name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define SVC_NAME_CAP (TS_MAX_NAME_LEN * 4 + 1)
#define SVC_NO_HEAP  SIZE_MAX

typedef struct svc svc;
typedef struct tsd_svc_call svc_call;

/* A connection serving a service. */
typedef struct tsd_svc_reg {
    svc *s;
    tsd_conn *c;
    uint32_t concurrency;
    uint32_t inflight;                 /* calls handed under it and not yet answered by it */
    struct tsd_svc_reg *sprev, *snext; /* in s's registrations */
    struct tsd_svc_reg *cnext;         /* in c's registrations */
} svc_reg;

struct svc {
    tsd_hnode node; /* in services.by_name; the name follows the struct */
    svc_reg *regs;
    svc_reg *rr; /* the registration to try first: the one after the last used */
    uint32_t n_regs;
    uint32_t n_queued;
    uint32_t n_handed;
    uint64_t calls; /* answered by its servers */
    svc_call *qhead, *qtail;
    uint64_t cost; /* bytes charged against --max-memory */
};

struct tsd_svc_call {
    tsd_hnode node; /* in services.by_id, keyed by id_key */
    uint8_t id_key[8];
    uint64_t id;
    svc *s;
    tsd_conn *caller; /* NULL once the caller was answered or left */
    uint32_t rid;
    uint32_t flags;
    uint64_t deadline;       /* uv_now ms */
    size_t heap_idx;         /* place in the deadline heap while caller != NULL */
    tsd_item *req;           /* the request's record while queued (held bytes) */
    tsd_conn *server;        /* the connection it was handed to; NULL while queued */
    svc_reg *reg;            /* the registration it counts against; NULL once that ended */
    svc_call *qprev, *qnext; /* queued: in s's queue; handed: in server's list */
    svc_call *cprev, *cnext; /* in caller's list while caller != NULL */
};

typedef struct tsd_services {
    tsd_server *srv;
    tsd_htab by_name;
    tsd_htab by_id;
    svc_call **heap;
    size_t heap_n, heap_cap;
    uv_timer_t *timer; /* allocated while calls wait for an answer (the heap is not empty) */
    uint64_t next_id;
    tsd_svc_stats st;
} tsd_services;

#define SVC_CALL_COST ((uint64_t)sizeof(svc_call))
#define SVC_REG_COST  ((uint64_t)sizeof(svc_reg))

/* ---------------------------------------------------------------------------------------------
 * State, deadlines
 */

static tsd_services *services(tsd_server *srv)
{
    if (srv->services != NULL)
        return srv->services;
    tsd_services *v = ts__calloc(1, sizeof(*v));
    if (v == NULL)
        return NULL;
    if (tsd_htab_init(&v->by_name) != 0) {
        ts__free(v);
        return NULL;
    }
    if (tsd_htab_init(&v->by_id) != 0) {
        tsd_htab_free(&v->by_name);
        ts__free(v);
        return NULL;
    }
    v->srv = srv;
    /*
     * Call ids start at a random point of [1, 2^62) each time tensord starts, so an answer a
     * server sends for a call of an earlier run (it reconnected to a restarted tensord) never
     * names a call of this one.
     */
    v->next_id = (srv->server_id >> 2) | 1;
    srv->services = v;
    return v;
}

static int heap_less(const svc_call *a, const svc_call *b)
{
    return a->deadline != b->deadline ? a->deadline < b->deadline : a->id < b->id;
}

static void heap_swap(tsd_services *v, size_t i, size_t j)
{
    svc_call *t = v->heap[i];
    v->heap[i] = v->heap[j];
    v->heap[j] = t;
    v->heap[i]->heap_idx = i;
    v->heap[j]->heap_idx = j;
}

static void heap_fix(tsd_services *v, size_t i)
{
    while (i > 0 && heap_less(v->heap[i], v->heap[(i - 1) / 2])) {
        heap_swap(v, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        if (l < v->heap_n && heap_less(v->heap[l], v->heap[m]))
            m = l;
        if (l + 1 < v->heap_n && heap_less(v->heap[l + 1], v->heap[m]))
            m = l + 1;
        if (m == i)
            return;
        heap_swap(v, i, m);
        i = m;
    }
}

static void timer_cb(uv_timer_t *t);

static void timer_closed(uv_handle_t *h)
{
    ts__free(h);
}

/* Arm the timer for the earliest deadline, or close it when no call waits. */
static void timer_arm(tsd_services *v)
{
    if (v->heap_n == 0) {
        if (v->timer != NULL) {
            uv_timer_stop(v->timer);
            uv_close((uv_handle_t *)v->timer, timer_closed);
            v->timer = NULL;
        }
        return;
    }
    uint64_t now = uv_now(v->srv->loop), d = v->heap[0]->deadline;
    uv_timer_start(v->timer, timer_cb, d > now ? d - now : 0, 0);
}

/* Add k to the deadline heap (the timer is made with the first). 0 or TS_ENOMEM. */
static int heap_push(tsd_services *v, svc_call *k)
{
    if (v->timer == NULL) {
        v->timer = ts__malloc(sizeof(*v->timer));
        if (v->timer == NULL)
            return TS_ENOMEM;
        uv_timer_init(v->srv->loop, v->timer);
        v->timer->data = v;
    }
    if (v->heap_n == v->heap_cap) {
        size_t cap = v->heap_cap ? v->heap_cap * 2 : 64;
        svc_call **h = ts__realloc(v->heap, cap * sizeof(*h));
        if (h == NULL) {
            timer_arm(v); /* closes the timer again when no call waits */
            return TS_ENOMEM;
        }
        v->heap = h;
        v->heap_cap = cap;
    }
    k->heap_idx = v->heap_n;
    v->heap[v->heap_n++] = k;
    heap_fix(v, k->heap_idx);
    if (k->heap_idx == 0)
        timer_arm(v);
    return 0;
}

static void heap_remove(tsd_services *v, svc_call *k)
{
    size_t i = k->heap_idx;
    if (i == SVC_NO_HEAP)
        return;
    k->heap_idx = SVC_NO_HEAP;
    v->heap_n--;
    if (i != v->heap_n) {
        v->heap[i] = v->heap[v->heap_n];
        v->heap[i]->heap_idx = i;
        heap_fix(v, i);
    }
    if (i == 0)
        timer_arm(v);
}

/* ---------------------------------------------------------------------------------------------
 * Services, calls
 */

static svc *svc_find(tsd_services *v, const uint8_t *name, size_t len)
{
    return (svc *)(void *)tsd_htab_find(&v->by_name, name, len);
}

static svc *svc_create(tsd_services *v, const uint8_t *name, size_t len)
{
    uint64_t cost = tsd_heap_block(sizeof(svc) + len);
    if (tsd_store_charge(v->srv, NULL, cost) != 0)
        return NULL;
    svc *s = ts__calloc(1, sizeof(*s) + len);
    if (s == NULL) {
        tsd_store_uncharge(v->srv, NULL, cost);
        return NULL;
    }
    s->cost = cost;
    s->node.name = (uint8_t *)(s + 1);
    memcpy(s->node.name, name, len);
    s->node.name_len = (uint8_t)len;
    s->node.hash = tsd_hash(name, len);
    tsd_htab_insert(&v->by_name, &s->node);
    v->st.services++;
    return s;
}

/* Free s when nothing refers to it any more. */
static void svc_maybe_free(tsd_services *v, svc *s)
{
    if (s->n_regs > 0 || s->n_queued > 0 || s->n_handed > 0)
        return;
    tsd_htab_remove(&v->by_name, &s->node);
    tsd_store_uncharge(v->srv, NULL, s->cost);
    v->st.services--;
    ts__free(s);
}

static void svc_printable(const svc *s, char *out, size_t cap)
{
    tsd_name_printable(s->node.name, s->node.name_len, out, cap);
}

/* The caller no longer waits for k (answered, or gone). */
static void call_detach(tsd_services *v, svc_call *k)
{
    tsd_conn *c = k->caller;
    if (c == NULL)
        return;
    if (k->cprev != NULL)
        k->cprev->cnext = k->cnext;
    else
        c->svc_calls = k->cnext;
    if (k->cnext != NULL)
        k->cnext->cprev = k->cprev;
    k->cprev = k->cnext = NULL;
    c->n_watch--;
    k->caller = NULL;
    heap_remove(v, k);
}

static void queue_unlink(svc *s, svc_call *k)
{
    if (k->qprev != NULL)
        k->qprev->qnext = k->qnext;
    else
        s->qhead = k->qnext;
    if (k->qnext != NULL)
        k->qnext->qprev = k->qprev;
    else
        s->qtail = k->qprev;
    k->qprev = k->qnext = NULL;
    s->n_queued--;
}

/* Remove k from its server's list of handed calls. */
static void handed_unlink(svc_call *k)
{
    tsd_conn *sc = k->server;
    if (k->qprev != NULL)
        k->qprev->qnext = k->qnext;
    else
        sc->svc_handed = k->qnext;
    if (k->qnext != NULL)
        k->qnext->qprev = k->qprev;
    k->qprev = k->qnext = NULL;
}

/* Free k, which its caller no longer waits for; s may be freed too. */
static void call_free(tsd_services *v, svc_call *k)
{
    svc *s = k->s;
    call_detach(v, k);
    if (k->server != NULL) {
        handed_unlink(k);
        if (k->reg != NULL)
            k->reg->inflight--;
        s->n_handed--;
        v->st.handed--;
    } else {
        queue_unlink(s, k);
        v->st.queued--;
    }
    if (k->req != NULL)
        tsd_store_item_drop(&v->srv->store, k->req, 1);
    tsd_htab_remove(&v->by_id, &k->node);
    tsd_store_uncharge(v->srv, NULL, tsd_heap_block(SVC_CALL_COST));
    ts__free(k);
    svc_maybe_free(v, s);
}

/* Answer k's caller with an error (when it still waits) and detach it. */
static void call_fail(tsd_services *v, svc_call *k, uint16_t status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void call_fail(tsd_services *v, svc_call *k, uint16_t status, const char *fmt, ...)
{
    if (k->caller == NULL)
        return;
    char msg[TS_MAX_ERRMSG];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1;
    tsd_reply_msg(k->caller, TS_OP_SVC_CALL, k->rid, status, msg, len);
    if (status == TS_ST_SERVICE_GONE)
        v->st.gone++;
    else if (status == TS_ST_TIMEOUT)
        v->st.timeouts++;
    call_detach(v, k);
}

/* 1 when r may be handed another call now. */
static int reg_has_room(const svc_reg *r)
{
    return r->inflight < r->concurrency && !r->c->out_blocked && !r->c->closing;
}

/* The registration to hand the next call to (round robin over those with room), or NULL. */
static svc_reg *reg_pick(svc *s)
{
    svc_reg *start = s->rr != NULL ? s->rr : s->regs;
    svc_reg *r = start;
    for (uint32_t i = 0; r != NULL && i < s->n_regs; i++) {
        if (reg_has_room(r))
            return r;
        r = r->snext != NULL ? r->snext : s->regs;
        if (r == start)
            break;
    }
    return NULL;
}

/*
 * Hand queued call k to r: the SVC_REQUEST push references the request's record. 0, or -1 when
 * r's connection takes no more output (k stays queued).
 */
static int hand(tsd_services *v, svc_call *k, svc_reg *r)
{
    svc *s = k->s;
    tsd_conn *sc = r->c;
    uint64_t now = uv_now(v->srv->loop);
    uint64_t rec_len = tsd_item_len(k->req);
    size_t head = ts__msg_svc_push_head_size(s->node.name_len);
    uint64_t body = head + rec_len + ts__msg_items_pad(rec_len);
    if (tsd_out_begin(sc, TS_OP_SVC_REQUEST, 0) != 0 ||
        tsd_out_hdr(sc, TS_OP_SVC_REQUEST, 0, TS_ST_OK, body) != 0)
        return -1;
    uint8_t *p = tsd_out_bytes(sc, head);
    if (p == NULL)
        return -1;
    ts__msg_svc_push m = {.call_id = k->id,
                          .timeout_ms = (uint32_t)(k->deadline > now ? k->deadline - now : 1),
                          .name = s->node.name,
                          .name_len = s->node.name_len,
                          .rec_len = rec_len};
    size_t hl;
    (void)ts__msg_svc_push_head_encode(p, head, &m, &hl); /* the room is exact */
    if (tsd_out_item(sc, k->req, 1) != 0)
        return -1;
    queue_unlink(s, k);
    v->st.queued--;
    /* The queued write holds the record now; its bytes count as orphaned until written. */
    tsd_store_item_drop(&v->srv->store, k->req, 1);
    k->req = NULL;
    k->server = sc;
    k->reg = r;
    k->qnext = sc->svc_handed;
    if (sc->svc_handed != NULL)
        sc->svc_handed->qprev = k;
    sc->svc_handed = k;
    r->inflight++;
    s->n_handed++;
    v->st.handed++;
    s->rr = r->snext;
    return 0;
}

/*
 * Hand queued calls to registrations with room, in arrival order. A registration whose
 * connection refuses the frame (out of memory, or being cut off) is skipped; after as many
 * refusals as there are registrations the calls stay queued for the next answer, registration
 * or deadline, so the walk is bounded.
 */
static void dispatch(tsd_services *v, svc *s)
{
    uint32_t refused = 0;
    while (s->qhead != NULL && refused <= s->n_regs) {
        svc_reg *r = reg_pick(s);
        if (r == NULL)
            return;
        if (hand(v, s->qhead, r) != 0) {
            s->rr = r->snext;
            refused++;
        }
    }
}

/* s has no servers left: fail the queued calls that did not ask to wait for one. */
static void fail_unwaiting(tsd_services *v, svc *s)
{
    char pn[SVC_NAME_CAP];
    svc_printable(s, pn, sizeof(pn));
    svc_call *k = s->qhead;
    while (k != NULL) {
        svc_call *next = k->qnext;
        if (!(k->flags & TS_SVC_CALL_WAIT)) {
            call_fail(v, k, TS_ST_SERVICE_GONE,
                      "service %s: its last server stopped serving before the call was handed "
                      "to one",
                      pn);
            call_free(v, k);
        }
        k = next;
    }
}

static void timer_cb(uv_timer_t *t)
{
    tsd_services *v = t->data;
    uint64_t now = uv_now(v->srv->loop);
    while (v->heap_n > 0 && v->heap[0]->deadline <= now) {
        svc_call *k = v->heap[0];
        char pn[SVC_NAME_CAP];
        svc_printable(k->s, pn, sizeof(pn));
        if (k->server == NULL) {
            call_fail(v, k, TS_ST_TIMEOUT,
                      "service %s: no server had room for the call before its timeout (%u "
                      "servers)",
                      pn, k->s->n_regs);
            call_free(v, k);
        } else {
            call_fail(v, k, TS_ST_TIMEOUT,
                      "service %s: the server did not answer call %llu before its timeout", pn,
                      (unsigned long long)k->id);
        }
    }
    timer_arm(v);
    tsd_server_flush(v->srv);
}

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

static void reply_state(tsd_conn *c, const ts__hdr *h, const svc *s)
{
    ts__msg_svc_state st = {0, 0, 0};
    if (s != NULL) {
        st.servers = s->n_regs;
        st.queued = s->n_queued;
        st.calls = s->calls;
    }
    uint8_t body[TS_MSG_SVC_STATE_SIZE];
    size_t n;
    (void)ts__msg_svc_state_encode(body, sizeof(body), &st, &n);
    tsd_reply(c, h->opcode, h->request_id, TS_ST_OK, body, n);
}

static svc_reg *reg_of(tsd_conn *c, const svc *s)
{
    for (svc_reg *r = c->svc_regs; r != NULL; r = r->cnext)
        if (r->s == s)
            return r;
    return NULL;
}

/* End registration r (its connection's handed calls stay that connection's to answer). */
static void reg_remove(tsd_services *v, svc_reg *r)
{
    svc *s = r->s;
    tsd_conn *c = r->c;
    for (svc_call *k = c->svc_handed; k != NULL; k = k->qnext)
        if (k->reg == r)
            k->reg = NULL;
    svc_reg **pp = &c->svc_regs;
    while (*pp != r)
        pp = &(*pp)->cnext;
    *pp = r->cnext;
    if (r->sprev != NULL)
        r->sprev->snext = r->snext;
    else
        s->regs = r->snext;
    if (r->snext != NULL)
        r->snext->sprev = r->sprev;
    if (s->rr == r)
        s->rr = r->snext;
    s->n_regs--;
    v->st.servers--;
    tsd_store_uncharge(v->srv, NULL, tsd_heap_block(SVC_REG_COST));
    ts__free(r);
    if (s->n_regs == 0)
        fail_unwaiting(v, s);
    svc_maybe_free(v, s);
}

static void op_register(tsd_conn *c, const ts__hdr *h, const ts__msg_svc_register_req *q)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (q->name_len == 0) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "SVC_REGISTER: a service needs a name");
        return;
    }
    if (q->flags != 0 || q->concurrency > TS_SVC_MAX_CONCURRENCY) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "SVC_REGISTER: flags must be 0 (got 0x%x) and concurrency at most %u (got "
                      "%u)",
                      q->flags, TS_SVC_MAX_CONCURRENCY, q->concurrency);
        return;
    }
    tsd_services *v = services(srv);
    if (v == NULL) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    svc *s = svc_find(v, q->name, q->name_len);
    svc_reg *r = s != NULL ? reg_of(c, s) : NULL;
    if (q->concurrency == 0) { /* stop serving it */
        if (r == NULL) {
            char pn[SVC_NAME_CAP];
            tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
            tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND,
                          "SVC_REGISTER: this connection does not serve service %s", pn);
            return;
        }
        reg_remove(v, r);
        s = svc_find(v, q->name, q->name_len);
        reply_state(c, h, s);
        return;
    }
    if (r != NULL) { /* a new concurrency for a registration */
        r->concurrency = q->concurrency;
        reply_state(c, h, s);
        dispatch(v, s);
        return;
    }
    uint64_t cost = tsd_heap_block(SVC_REG_COST);
    if (s == NULL && (s = svc_create(v, q->name, q->name_len)) == NULL) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "SVC_REGISTER: no memory for the service (--max-memory)");
        return;
    }
    if (tsd_store_charge(srv, NULL, cost) != 0) {
        svc_maybe_free(v, s);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "SVC_REGISTER: no memory for the registration (--max-memory)");
        return;
    }
    r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        tsd_store_uncharge(srv, NULL, cost);
        svc_maybe_free(v, s);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    r->s = s;
    r->c = c;
    r->concurrency = q->concurrency;
    r->snext = s->regs;
    if (s->regs != NULL)
        s->regs->sprev = r;
    s->regs = r;
    s->n_regs++;
    r->cnext = c->svc_regs;
    c->svc_regs = r;
    v->st.servers++;
    reply_state(c, h, s);
    dispatch(v, s);
}

void tsd_svc_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    /* Counted in its ops_ key by tsd_op_dispatch, as every request without a record. */
    if (tsd_shard_refuse(c, h->opcode, h->request_id, m->u.svc_register.name,
                         m->u.svc_register.name_len))
        return;
    op_register(c, h, &m->u.svc_register);
}

static void drop_upload(tsd_server *srv, tsd_item *item)
{
    tsd_store_unreserve(&srv->store, tsd_item_len(item));
    tsd_item_unref(item);
}

static void op_call(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                    const uint8_t *fixed, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    char pn[SVC_NAME_CAP];
    ts__msg_svc_call_fixed f;
    ts__msg_svc_call_fixed_decode(fixed, &f);
    if (nl == 0 || f.timeout_ms == 0 || f.timeout_ms > TSD_MAX_WAIT_MS ||
        (f.flags & ~TS_SVC_CALL_FLAGS_KNOWN) != 0) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "SVC_CALL: a service name, a timeout of 1 to %u ms (got %u) and known flags "
                      "(got 0x%x) are needed",
                      TSD_MAX_WAIT_MS, f.timeout_ms, f.flags);
        return;
    }
    tsd_services *v = services(srv);
    if (v == NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    svc *s = svc_find(v, name, nl);
    if ((s == NULL || s->n_regs == 0) && !(f.flags & TS_SVC_CALL_WAIT)) {
        drop_upload(srv, item);
        tsd_name_printable(name, nl, pn, sizeof(pn));
        tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND, "no server serves service %s", pn);
        return;
    }
    if (c->n_watch >= srv->cfg.max_watch) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_TOO_MANY_CLIENTS,
                      "SVC_CALL: this connection already has %u waits and calls pending "
                      "(--max-watch)",
                      c->n_watch);
        return;
    }
    uint64_t cost = tsd_heap_block(SVC_CALL_COST);
    svc_call *k = NULL;
    int made = s == NULL;
    if (s == NULL && (s = svc_create(v, name, nl)) == NULL)
        goto oom;
    if (tsd_store_charge(srv, NULL, cost) != 0)
        goto oom;
    k = ts__calloc(1, sizeof(*k));
    if (k == NULL) {
        tsd_store_uncharge(srv, NULL, cost);
        goto oom;
    }
    k->id = v->next_id++;
    ts__put_u64le(k->id_key, k->id);
    k->node.name = k->id_key;
    k->node.name_len = sizeof(k->id_key);
    k->node.hash = tsd_hash(k->id_key, sizeof(k->id_key));
    k->s = s;
    k->rid = rid;
    k->flags = f.flags;
    k->deadline = uv_now(srv->loop) + f.timeout_ms;
    k->heap_idx = SVC_NO_HEAP;
    if (heap_push(v, k) != 0) {
        ts__free(k);
        tsd_store_uncharge(srv, NULL, cost);
        goto oom;
    }
    tsd_htab_insert(&v->by_id, &k->node);
    tsd_store_item_take(&srv->store, item); /* from here on the record is counted as held */
    k->req = item;
    k->caller = c;
    k->cnext = c->svc_calls;
    if (c->svc_calls != NULL)
        c->svc_calls->cprev = k;
    c->svc_calls = k;
    c->n_watch++;
    k->qprev = s->qtail;
    if (s->qtail != NULL)
        s->qtail->qnext = k;
    else
        s->qhead = k;
    s->qtail = k;
    s->n_queued++;
    v->st.queued++;
    v->st.calls++;
    dispatch(v, s);
    return;
oom:
    drop_upload(srv, item);
    if (made && s != NULL)
        svc_maybe_free(v, s);
    tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                  "SVC_CALL: no memory to keep the call (--max-memory)");
}

/* Route an answer (a record, or an error message) to k's caller. */
static void forward(tsd_services *v, svc_call *k, uint16_t status, tsd_item *item)
{
    tsd_conn *cc = k->caller;
    uint64_t len = tsd_item_len(item);
    if (status != TS_ST_OK) {
        tsd_reply_msg(cc, TS_OP_SVC_CALL, k->rid, status, (const char *)tsd_item_data(item),
                      (size_t)len);
    } else {
        size_t head = (size_t)ts__items_head_size(1);
        uint64_t body = head + len + ts__msg_items_pad(len);
        uint8_t *p = NULL;
        if (tsd_out_begin(cc, TS_OP_SVC_CALL, k->rid) == 0 &&
            tsd_out_hdr(cc, TS_OP_SVC_CALL, k->rid, TS_ST_OK, body) == 0)
            p = tsd_out_bytes(cc, head);
        if (p != NULL) {
            size_t hl;
            (void)ts__msg_items_head_encode(p, head, k->id, 1, 0, &len, &hl);
            (void)tsd_out_item(cc, item, 1);
        }
    }
    v->st.answered++;
    call_detach(v, k);
}

static void op_reply(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                     const uint8_t *fixed, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    ts__msg_svc_reply_fixed f;
    ts__msg_svc_reply_fixed_decode(fixed, &f);
    if (f.reserved16 != 0 || f.reserved32 != 0) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "SVC_REPLY: the reserved fields must be 0 (got %u and %u)",
                      (unsigned)f.reserved16, (unsigned)f.reserved32);
        return;
    }
    if (f.status != TS_ST_OK && !ts__msg_svc_status_allowed(f.status)) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "SVC_REPLY: status %u is not one a service may answer with", f.status);
        return;
    }
    tsd_services *v = srv->services;
    uint8_t key[8];
    ts__put_u64le(key, f.call_id);
    svc_call *k = v != NULL ? (svc_call *)(void *)tsd_htab_find(&v->by_id, key, sizeof(key)) : NULL;
    if (k == NULL || k->server != c) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND,
                      "SVC_REPLY: call %llu is not awaiting an answer from this connection",
                      (unsigned long long)f.call_id);
        return;
    }
    svc *s = k->s;
    if (nl != s->node.name_len || memcmp(name, s->node.name, nl) != 0) {
        drop_upload(srv, item);
        char pn[SVC_NAME_CAP];
        svc_printable(s, pn, sizeof(pn));
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "SVC_REPLY: call %llu belongs to service %s",
                      (unsigned long long)f.call_id, pn);
        return;
    }
    tsd_store_item_take(&srv->store, item);
    if (k->caller != NULL)
        forward(v, k, f.status, item);
    else
        v->st.late_replies++;
    tsd_store_item_drop(&srv->store, item, 1);
    s->calls++;
    tsd_reply(c, op, rid, TS_ST_OK, NULL, 0);
    /* The call's place at its server is free: hand it the next queued one. */
    s->n_handed++; /* keep s alive across call_free */
    call_free(v, k);
    s->n_handed--;
    dispatch(v, s);
    svc_maybe_free(v, s);
}

void tsd_svc_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                    const uint8_t *fixed, tsd_item *item)
{
    c->srv->stats.ops[h->opcode]++;
    if (h->opcode == TS_OP_SVC_CALL)
        op_call(c, h, name, name_len, fixed, item);
    else
        op_reply(c, h, name, name_len, fixed, item);
}

/* ---------------------------------------------------------------------------------------------
 * Connections, stats, free
 */

void tsd_svc_conn_gone(tsd_server *srv, tsd_conn *c)
{
    tsd_services *v = srv->services;
    if (v == NULL)
        return;
    /* Calls it made: nobody waits for them any more; queued ones go now. */
    while (c->svc_calls != NULL) {
        svc_call *k = c->svc_calls;
        call_detach(v, k);
        if (k->server == NULL)
            call_free(v, k);
    }
    /* Calls it held: their callers learn at once that the server left. */
    while (c->svc_handed != NULL) {
        svc_call *k = c->svc_handed;
        svc *s = k->s;
        char pn[SVC_NAME_CAP];
        svc_printable(s, pn, sizeof(pn));
        call_fail(v, k, TS_ST_SERVICE_GONE,
                  "service %s: the server handling the call disconnected before answering", pn);
        s->n_handed++; /* keep s alive for dispatch */
        call_free(v, k);
        s->n_handed--;
        if (c->svc_regs != NULL || s->n_regs > 0)
            dispatch(v, s);
        svc_maybe_free(v, s);
    }
    while (c->svc_regs != NULL) {
        svc *s = c->svc_regs->s;
        s->n_handed++;
        reg_remove(v, c->svc_regs);
        s->n_handed--;
        dispatch(v, s);
        svc_maybe_free(v, s);
    }
}

size_t tsd_svc_conn_stop(tsd_server *srv, tsd_conn *c)
{
    tsd_services *v = srv->services;
    size_t n = 0;
    if (v == NULL)
        return 0;
    while (c->svc_calls != NULL) {
        svc_call *k = c->svc_calls;
        tsd_reply_msg(c, TS_OP_SVC_CALL, k->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                      sizeof(TSD_SHUTDOWN_MSG) - 1);
        n++;
        call_detach(v, k);
        if (k->server == NULL)
            call_free(v, k);
    }
    return n;
}

void tsd_svc_stats_get(const tsd_server *srv, tsd_svc_stats *st)
{
    if (srv->services == NULL)
        memset(st, 0, sizeof(*st));
    else
        *st = srv->services->st;
}

void tsd_svc_free(tsd_server *srv)
{
    tsd_services *v = srv->services;
    if (v == NULL)
        return;
    for (size_t b = 0; v->by_id.buckets != NULL && b <= v->by_id.mask; b++) {
        while (v->by_id.buckets[b] != NULL) {
            svc_call *k = (svc_call *)(void *)v->by_id.buckets[b];
            tsd_htab_remove(&v->by_id, &k->node);
            if (k->req != NULL)
                tsd_store_item_drop(&srv->store, k->req, 0);
            ts__free(k);
        }
    }
    for (size_t b = 0; v->by_name.buckets != NULL && b <= v->by_name.mask; b++) {
        while (v->by_name.buckets[b] != NULL) {
            svc *s = (svc *)(void *)v->by_name.buckets[b];
            tsd_htab_remove(&v->by_name, &s->node);
            while (s->regs != NULL) {
                svc_reg *r = s->regs;
                s->regs = r->snext;
                ts__free(r);
            }
            ts__free(s);
        }
    }
    tsd_htab_free(&v->by_id);
    tsd_htab_free(&v->by_name);
    ts__free(v->heap);
    v->heap_n = 0;
    timer_arm(v); /* closes the timer, if any */
    ts__free(v);
    srv->services = NULL;
}
