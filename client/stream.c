/*
 * Streams on the client (include/tensorshare/stream.h): the low-level calls, one blocking request
 * each, whose bodies src/msg_stream.c encodes into the request's flat buffer (STREAM_APPEND is an
 * upload: its record is sent from the caller's memory like a PUT's; STREAM_INFO's body is a
 * name); reply.c parses the replies (the fixed states into ts__req.stream, ENTRIES into items).
 * On top of them, without any access to the connection, the producer helper (appends that wait
 * for credit) and the consumer helper (batches re-sliced to the caller's row count, acknowledged
 * as they are used).
 *
 * Threads: the low-level calls are blocking calls of a client like any other (any thread, never
 * from a callback). A producer or a consumer is used by one thread at a time.
 */
#include "tensorshare/stream.h"

#include "internal.h"

#include "msg.h"

#include <stdlib.h>

/* entries a consumer asks for per read when its options leave prefetch at the default */
#define TS__STREAM_DEFAULT_PREFETCH 4
/* the replay window of a stream created with the default configuration (entries) */
#define TS__STREAM_DEFAULT_MAX_ENTRIES 1024
/*
 * A consumer waiting for entries splits its wait into reads of at most half its lease (ms):
 * a member is live only while it reads or acknowledges within its lease, so a consumer that
 * waits longer in one read would look dead to the producer's credits and to its group.
 */
#define TS__STREAM_WAIT_LEASE_DIV 2

/* ---------------------------------------------------------------------------------------------
 * Requests
 */

/*
 * The fields of a stream request without a record, for enc_stream: op says which encoder writes
 * the body, and so which ts__msg_stream_*_req m points to.
 */
typedef struct stream_body {
    uint8_t op;
    const void *m;
} stream_body;

/* The ts__flat_enc of every stream request without a record: b->op's encoder on b->m. */
static int enc_stream(uint8_t *out, size_t cap, const void *ctx, size_t *len)
{
    const stream_body *b = ctx;
    switch (b->op) {
    case TS_OP_STREAM_CREATE:
        return ts__msg_stream_create_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_MARK:
        return ts__msg_stream_mark_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_CREDIT:
        return ts__msg_stream_credit_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_JOIN:
        return ts__msg_stream_join_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_READ:
        return ts__msg_stream_read_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_ACK:
        return ts__msg_stream_ack_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_LEAVE:
        return ts__msg_stream_leave_req_encode(out, cap, b->m, len);
    case TS_OP_STREAM_RANGE:
        return ts__msg_stream_range_req_encode(out, cap, b->m, len);
    default:
        return TS_EINVAL; /* not a request of this file */
    }
}

/*
 * The name, group and member of a member request into m (member may be NULL where allow_no_member
 * says so: LEAVE of a whole group). 0 or the error, its message set.
 */
static int member_ids(ts__msg_stream_member_req *m, const char *name, const char *group,
                      const char *member, int allow_no_member)
{
    memset(m, 0, sizeof(*m));
    int rc = ts__api_check_id("stream", name, &m->name_len);
    if (rc == 0)
        rc = ts__api_check_id("group", group, &m->group_len);
    if (rc == 0 && !(allow_no_member && member == NULL))
        rc = ts__api_check_id("member", member, &m->member_len);
    m->name = (const uint8_t *)name;
    m->group = (const uint8_t *)group;
    m->member = m->member_len > 0 ? (const uint8_t *)member : NULL;
    return rc;
}

/*
 * Send stream request op, whose body of cap bytes enc_stream writes from m, and wait for its end
 * (the server may hold it for wait_ms, sent in m). 0 with *done the completed request (the caller
 * frees it), or the error, its message set.
 */
static int call(ts_client_t *c, uint8_t op, size_t cap, const void *m, uint32_t wait_ms,
                ts__req **done)
{
    stream_body b = {.op = op, .m = m};
    int rc;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, op, cap, enc_stream, &b, wait_ms, &rc);
    return r == NULL ? rc : ts__api_run_blocking(c, r, done);
}

static void state_out(const ts__msg_stream_state *m, ts_stream_state_t *st)
{
    if (st == NULL)
        return;
    st->first_id = m->first_id;
    st->last_id = m->last_id;
    st->bytes = m->bytes;
    st->n_entries = m->n_entries;
    st->n_groups = m->n_groups;
    st->n_stale = m->n_stale;
    st->credit = m->credit;
    st->window = m->window;
}

static void append_out(const ts__msg_stream_append_state *m, ts_stream_append_t *res)
{
    if (res == NULL)
        return;
    res->id = m->id;
    res->first_id = m->first_id;
    res->credit = m->credit;
    res->n_entries = m->n_entries;
}

/* ---------------------------------------------------------------------------------------------
 * Batches
 */

struct ts_stream_batch_s {
    ts_items_t *items; /* the records, and the heads after them (internal.h) */
    ts__stream_tail *tail;
};

/* Wrap the items of an ENTRIES reply (taken over). NULL when out of memory (items freed). */
static ts_stream_batch_t *batch_wrap(ts_items_t *items)
{
    ts_stream_batch_t *b = ts__calloc(1, sizeof(*b));
    if (b == NULL) {
        ts_items_free(items);
        return NULL;
    }
    b->items = items;
    b->tail = ts__items_stream_tail(items);
    return b;
}

/* Entry i's head, or NULL out of range. */
static const ts__stream_head *batch_head(const ts_stream_batch_t *b, size_t i)
{
    if (b == NULL || i >= b->items->count)
        return NULL;
    return &b->tail->e[i];
}

size_t ts_stream_batch_count(const ts_stream_batch_t *b)
{
    return b == NULL ? 0 : b->items->count;
}

uint64_t ts_stream_batch_first_id(const ts_stream_batch_t *b)
{
    return b == NULL ? 0 : b->tail->first_id;
}

uint64_t ts_stream_batch_last_id(const ts_stream_batch_t *b)
{
    return b == NULL ? 0 : b->tail->last_id;
}

uint64_t ts_stream_batch_lost(const ts_stream_batch_t *b)
{
    return b == NULL ? 0 : b->tail->lost;
}

uint64_t ts_stream_batch_id(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h == NULL ? 0 : h->id;
}

int ts_stream_batch_is_marker(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h != NULL && h->kind == TS_STREAM_ENTRY_MARKER;
}

uint64_t ts_stream_batch_tag(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h == NULL ? 0 : h->tag;
}

const ts_value_t *ts_stream_batch_value(const ts_stream_batch_t *b, size_t i)
{
    return batch_head(b, i) == NULL ? NULL : b->items->items[i];
}

uint32_t ts_stream_batch_deliveries(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h == NULL ? 0 : h->deliveries;
}

int ts_stream_batch_redelivered(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h != NULL && (h->flags & TS_STREAM_ENTRY_REDELIVERED) != 0;
}

uint32_t ts_stream_batch_rows_done(const ts_stream_batch_t *b, size_t i)
{
    const ts__stream_head *h = batch_head(b, i);
    return h == NULL ? 0 : h->rows_done;
}

void ts_stream_batch_free(ts_stream_batch_t *b)
{
    if (b == NULL)
        return;
    ts_items_free(b->items);
    ts__free(b);
}

/* ---------------------------------------------------------------------------------------------
 * Low-level calls
 */

void ts_stream_config_init(ts_stream_config_t *cfg)
{
    if (cfg == NULL)
        return;
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_entries = TS__STREAM_DEFAULT_MAX_ENTRIES;
}

int ts_stream_create(ts_client_t *c, const char *name, const ts_stream_config_t *cfg,
                     ts_stream_state_t *st)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts_stream_config_t def;
    if (cfg == NULL) {
        ts_stream_config_init(&def);
        cfg = &def;
    }
    ts__msg_stream_create_req m = {.name = (const uint8_t *)name,
                                   .max_entries = cfg->max_entries,
                                   .max_bytes = cfg->max_bytes,
                                   .max_age_ms = cfg->max_age_ms,
                                   .window = cfg->window,
                                   .lease_ms = cfg->lease_ms,
                                   .flags = 0};
    rc = ts__api_check_id("stream", name, &m.name_len);
    if (rc != 0)
        return rc;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_CREATE, ts__msg_stream_create_req_size(m.name_len), &m, 0, &done);
    if (rc != 0)
        return rc;
    state_out(&done->stream.state, st);
    ts__req_free(done);
    return 0;
}

int ts_stream_append(ts_client_t *c, const char *name, const ts_value_t *item,
                     ts_stream_append_t *res)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t len;
    if ((rc = ts__api_check_id("stream", name, &len)) != 0)
        return rc;
    if (item == NULL)
        return ts__fail(TS_EINVAL, "no item to append");
    /* The body is a PUT's: the name, then the record, sent from the caller's memory. */
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, TS_OP_STREAM_APPEND, name, &rc);
    if (r == NULL || (rc = ts__api_borrow_record(r, item)) != 0)
        return rc;
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    append_out(&done->stream.append, res);
    ts__req_free(done);
    return 0;
}

int ts_stream_mark(ts_client_t *c, const char *name, uint64_t tag, ts_stream_append_t *res)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_mark_req m = {.name = (const uint8_t *)name, .tag = tag};
    if ((rc = ts__api_check_id("stream", name, &m.name_len)) != 0)
        return rc;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_MARK, ts__msg_stream_mark_req_size(m.name_len), &m, 0, &done);
    if (rc != 0)
        return rc;
    append_out(&done->stream.append, res);
    ts__req_free(done);
    return 0;
}

int ts_stream_credit(ts_client_t *c, const char *name, int timeout_ms, ts_stream_state_t *st)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_credit_req m = {.name = (const uint8_t *)name};
    if ((rc = ts__api_check_id("stream", name, &m.name_len)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_CREDIT, ts__msg_stream_credit_req_size(m.name_len), &m, m.timeout_ms,
              &done);
    if (rc != 0)
        return rc;
    ts__msg_stream_state s = done->stream.state;
    ts__req_free(done);
    state_out(&s, st);
    if (s.credit == 0)
        return ts__fail(TS_ETIMEDOUT,
                        "no credit on stream '%s' within %u ms: a live group is %u entries behind",
                        name, m.timeout_ms, s.window);
    return 0;
}

int ts_stream_join(ts_client_t *c, const char *name, const char *group, const char *member,
                   ts_stream_start_t start, int lease_ms, ts_stream_join_t *res)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_member_req m;
    if ((rc = member_ids(&m, name, group, member, 0)) != 0)
        return rc;
    if (start != TS_STREAM_OLDEST && start != TS_STREAM_NEWEST)
        return ts__fail(TS_EINVAL, "start %d: expected TS_STREAM_OLDEST or TS_STREAM_NEWEST",
                        (int)start);
    if (lease_ms < 0)
        return ts__fail(TS_EINVAL, "lease_ms %d: expected 0 (the group's) or milliseconds",
                        lease_ms);
    m.start = start == TS_STREAM_NEWEST ? TS_STREAM_START_NEWEST : TS_STREAM_START_OLDEST;
    m.lease_ms = (uint32_t)lease_ms;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_JOIN,
              ts__msg_stream_join_req_size(m.name_len, m.group_len, m.member_len), &m, 0, &done);
    if (rc != 0)
        return rc;
    if (res != NULL) {
        const ts__msg_stream_join_state *j = &done->stream.join;
        res->next_id = j->next_id;
        res->floor = j->floor;
        res->lost = j->lost;
        res->pending = j->pending;
        res->members = j->members;
        res->rows_done = j->rows_done;
    }
    ts__req_free(done);
    return 0;
}

/* Check a count of entries to read: 1..TS_STREAM_READ_MAX. */
static int check_max_entries(size_t max_entries)
{
    if (max_entries < 1 || max_entries > TS_STREAM_READ_MAX)
        return ts__fail(TS_EINVAL, "max_entries %zu: expected 1 to %d", max_entries,
                        TS_STREAM_READ_MAX);
    return 0;
}

/*
 * Send ENTRIES request op (STREAM_READ, STREAM_RANGE: as call) and wait for its end: 0 and *out,
 * or the error.
 */
static int call_entries(ts_client_t *c, uint8_t op, size_t cap, const void *m, uint32_t wait_ms,
                        ts_stream_batch_t **out)
{
    ts__req *done;
    int rc = call(c, op, cap, m, wait_ms, &done);
    if (rc != 0)
        return rc;
    ts_items_t *items = done->res.items;
    done->res.items = NULL;
    ts__req_free(done);
    ts_stream_batch_t *b = batch_wrap(items);
    if (b == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    *out = b;
    return 0;
}

int ts_stream_read(ts_client_t *c, const char *name, const char *group, const char *member,
                   uint64_t ack_through, size_t max_entries, int timeout_ms,
                   ts_stream_batch_t **out)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_member_req m;
    if ((rc = member_ids(&m, name, group, member, 0)) != 0 ||
        (rc = check_max_entries(max_entries)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    m.ack_through = ack_through;
    m.max_entries = (uint32_t)max_entries;
    return call_entries(c, TS_OP_STREAM_READ,
                        ts__msg_stream_read_req_size(m.name_len, m.group_len, m.member_len), &m,
                        m.timeout_ms, out);
}

int ts_stream_ack(ts_client_t *c, const char *name, const char *group, const char *member,
                  uint64_t first, uint64_t last, uint32_t rows, ts_stream_ack_t *res)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_member_req m;
    if ((rc = member_ids(&m, name, group, member, 0)) != 0)
        return rc;
    m.first = first;
    m.last = last;
    m.rows = rows;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_ACK,
              ts__msg_stream_ack_req_size(m.name_len, m.group_len, m.member_len), &m, 0, &done);
    if (rc != 0)
        return rc;
    if (res != NULL) {
        res->acked = done->stream.ack.acked;
        res->floor = done->stream.ack.floor;
        res->pending = done->stream.ack.pending;
        res->credit = done->stream.ack.credit;
    }
    ts__req_free(done);
    return 0;
}

int ts_stream_leave(ts_client_t *c, const char *name, const char *group, const char *member,
                    ts_stream_state_t *st)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_member_req m;
    if ((rc = member_ids(&m, name, group, member, 1)) != 0)
        return rc;
    ts__req *done;
    rc = call(c, TS_OP_STREAM_LEAVE,
              ts__msg_stream_leave_req_size(m.name_len, m.group_len, m.member_len), &m, 0, &done);
    if (rc != 0)
        return rc;
    state_out(&done->stream.state, st);
    ts__req_free(done);
    return 0;
}

int ts_stream_info(ts_client_t *c, const char *name, ts_value_t **out)
{
    return ts__api_info(c, TS_OP_STREAM_INFO, "stream", name, out);
}

int ts_stream_range(ts_client_t *c, const char *name, uint64_t after_id, size_t max_entries,
                    int timeout_ms, ts_stream_batch_t **out)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_stream_range_req m = {.name = (const uint8_t *)name, .after_id = after_id};
    if ((rc = ts__api_check_id("stream", name, &m.name_len)) != 0 ||
        (rc = check_max_entries(max_entries)) != 0 ||
        (rc = ts__wire_timeout(c, timeout_ms, &m.timeout_ms)) != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    m.max_entries = (uint32_t)max_entries;
    return call_entries(c, TS_OP_STREAM_RANGE, ts__msg_stream_range_req_size(m.name_len), &m,
                        m.timeout_ms, out);
}

/* ---------------------------------------------------------------------------------------------
 * Deadlines of the helpers
 */

/*
 * A helper's wait of timeout_ms (TS_TIMEOUT_DEFAULT: the client's request timeout;
 * TS_TIMEOUT_INFINITE: none): *infinite, or the monotonic deadline *deadline_ns.
 */
static void helper_deadline(const ts_client_t *c, int timeout_ms, int *infinite,
                            uint64_t *deadline_ns)
{
    *infinite = timeout_ms == TS_TIMEOUT_INFINITE;
    int64_t ms = timeout_ms == TS_TIMEOUT_DEFAULT ? c->opts.request_timeout_ms : timeout_ms;
    *deadline_ns = ts__now_ns() + (uint64_t)(ms > 0 ? ms : 0) * 1000000u;
}

/* ms left until deadline_ns (0 when it passed), at most cap. */
static uint32_t ms_left(uint64_t deadline_ns, uint32_t cap)
{
    uint64_t now = ts__now_ns();
    uint64_t left = deadline_ns > now ? (deadline_ns - now) / 1000000u : 0;
    return left < cap ? (uint32_t)left : cap;
}

/* Check a helper's timeout: ms >= 0, TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE. */
static int check_helper_timeout(const char *what, int ms)
{
    if (ms >= 0 || ms == TS_TIMEOUT_DEFAULT || ms == TS_TIMEOUT_INFINITE)
        return 0;
    return ts__fail(TS_EINVAL,
                    "%s %d: expected milliseconds >= 0, TS_TIMEOUT_DEFAULT or TS_TIMEOUT_INFINITE",
                    what, ms);
}

/* ---------------------------------------------------------------------------------------------
 * The producer
 */

struct ts_stream_producer_s {
    ts_client_t *c; /* borrowed */
    char *name;
    int block_ms;
    uint32_t credit; /* as the last reply said; 0 makes the next push wait for credit first */
    uint64_t waits;
};

int ts_stream_producer_open(ts_stream_producer_t **out, ts_client_t *c, const char *name,
                            const ts_stream_config_t *cfg, int block_ms)
{
    size_t len = 0;
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    if ((rc = ts__api_check_id("stream", name, &len)) != 0 ||
        (rc = check_helper_timeout("block_ms", block_ms)) != 0)
        return rc;
    ts_stream_state_t st = {0};
    if (cfg != NULL) {
        rc = ts_stream_create(c, name, cfg, &st);
    } else {
        /* A look at the credit tells whether the stream exists, without waiting. */
        rc = ts_stream_credit(c, name, 0, &st);
        if (rc == TS_ETIMEDOUT && !ts_last_error_no_reply()) { /* exists; its window is full */
            ts__set_last_error(NULL, 0);
            rc = 0;
        }
    }
    if (rc != 0)
        return rc;
    ts_stream_producer_t *p = ts__calloc(1, sizeof(*p));
    if (p == NULL || (p->name = ts__strndup(name, len)) == NULL) {
        ts__free(p);
        return ts__fail(TS_ENOMEM, NULL);
    }
    p->c = c;
    p->block_ms = block_ms;
    p->credit = st.credit;
    *out = p;
    return 0;
}

/*
 * Wait for credit until deadline_ns (or without end), in waits of at most the request timeout.
 * 0 with p->credit updated, TS_ETIMEDOUT when the deadline passed, or the error.
 */
static int producer_wait(ts_stream_producer_t *p, int infinite, uint64_t deadline_ns)
{
    uint32_t step = (uint32_t)p->c->opts.request_timeout_ms;
    p->waits++;
    for (;;) {
        uint32_t ms = infinite ? step : ms_left(deadline_ns, step);
        if (ms == 0)
            return ts__fail(TS_ETIMEDOUT, "stream '%s' had no credit within the producer's %d ms",
                            p->name, p->block_ms);
        ts_stream_state_t st = {0};
        int rc = ts_stream_credit(p->c, p->name, (int)ms, &st);
        if (rc == 0) {
            p->credit = st.credit;
            return 0;
        }
        /* tensord's TS_ETIMEDOUT: the window is full; the client's own: tensord said nothing. */
        if (rc != TS_ETIMEDOUT || ts_last_error_no_reply())
            return rc;
    }
}

int ts_stream_producer_push(ts_stream_producer_t *p, const ts_value_t *item, uint64_t *id)
{
    if (p == NULL || item == NULL)
        return ts__fail(TS_EINVAL, "no producer or no item");
    int infinite;
    uint64_t deadline_ns;
    helper_deadline(p->c, p->block_ms, &infinite, &deadline_ns);
    for (;;) {
        int rc;
        if (p->credit == 0 && p->block_ms != 0 &&
            (rc = producer_wait(p, infinite, deadline_ns)) != 0)
            return rc;
        ts_stream_append_t res = {0};
        rc = ts_stream_append(p->c, p->name, item, &res);
        if (rc == 0) {
            p->credit = res.credit;
            if (id != NULL)
                *id = res.id;
            return 0;
        }
        if (rc != TS_EAGAIN)
            return rc;
        /* Another producer took the room, or the first push found the window full. */
        p->credit = 0;
        if (p->block_ms == 0)
            return rc;
    }
}

int ts_stream_producer_end_epoch(ts_stream_producer_t *p, uint64_t tag, uint64_t *id)
{
    if (p == NULL)
        return ts__fail(TS_EINVAL, "no producer");
    ts_stream_append_t res = {0};
    int rc = ts_stream_mark(p->c, p->name, tag, &res);
    if (rc != 0)
        return rc;
    p->credit = res.credit;
    if (id != NULL)
        *id = res.id;
    return 0;
}

uint64_t ts_stream_producer_waits(const ts_stream_producer_t *p)
{
    return p == NULL ? 0 : p->waits;
}

void ts_stream_producer_free(ts_stream_producer_t *p)
{
    if (p == NULL)
        return;
    ts__free(p->name);
    ts__free(p);
}

/* ---------------------------------------------------------------------------------------------
 * The consumer
 *
 * It holds at most one read's entries (batch, from pos on) and at most one batch being built
 * (asm: the rows copied so far from entries of earlier reads). Ids it tracks for acknowledging:
 * done, the entries wholly handed out and not acknowledged yet; asm.ids, the entries wholly
 * copied into the batch being built (not handed out yet); part, the one entry of which some rows
 * were handed out and others were not. A read acknowledges (ack_through) the largest done id
 * below every id still open, so that no entry it has not handed out is ever acknowledged;
 * commit acknowledges the rest id range by id range, and part's rows with STREAM_ACK rows.
 */

/* One tensor of the batch being built: the root tensor, or a tensor under a key of a root map. */
typedef struct col {
    size_t key;      /* index in the root map (unused for a root tensor) */
    ts_value_t *t;   /* the batch's tensor value (owned by asm.out) */
    size_t row_size; /* bytes per row */
} col;

typedef struct asm_batch {
    ts_value_t *out; /* NULL when no batch is being built */
    int is_map;
    col *cols;
    size_t ncols;
    uint32_t cap;    /* rows the batch is built for */
    uint32_t filled; /* rows copied into it */
    uint64_t first_id, last_id;
    uint64_t *ids; /* entries wholly copied into it */
    size_t nids, ids_cap;
    uint32_t part_rows; /* rows copied into it from the entry at the consumer's pos */
} asm_batch;

struct ts_stream_consumer_s {
    ts_client_t *c; /* borrowed */
    char *name, *group, *member;
    ts_stream_consumer_options_t o;
    ts_stream_batch_t *batch; /* the last read's entries */
    size_t pos;               /* the next entry of batch to use */
    uint32_t off;             /* rows of the entry at pos already used (its rows_done at first) */
    int off_set;              /* off is set for the entry at pos */
    asm_batch a;
    uint64_t *done;
    size_t ndone, done_cap;
    int have_part;
    uint64_t part_id;
    uint32_t part_rows;  /* rows of part handed out */
    uint32_t part_acked; /* rows of part the server knows as consumed */
    uint64_t lost;
    int rejoin; /* a read failed without an answer: join again before the next read */
};

void ts_stream_consumer_options_init(ts_stream_consumer_options_t *o)
{
    if (o == NULL)
        return;
    memset(o, 0, sizeof(*o));
    o->start = TS_STREAM_OLDEST;
    o->prefetch = TS__STREAM_DEFAULT_PREFETCH;
    o->timeout_ms = TS_TIMEOUT_DEFAULT;
}

/* Grow an id array to hold at least need ids. 0 or TS_ENOMEM. */
static int ids_reserve(uint64_t **ids, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    size_t n = *cap > 0 ? *cap : 16;
    while (n < need)
        n *= 2;
    uint64_t *p = ts__realloc(*ids, n * sizeof(uint64_t));
    if (p == NULL)
        return TS_ENOMEM;
    *ids = p;
    *cap = n;
    return 0;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void asm_reset(asm_batch *a)
{
    ts_value_free(a->out);
    a->out = NULL;
    ts__free(a->cols);
    a->cols = NULL;
    a->ncols = 0;
    a->filled = 0;
    a->nids = 0;
    a->part_rows = 0;
}

/* 1 when tensor t has the dtype and trailing dimensions of model (its rows may differ). */
static int same_layout(const ts_tensor_t *t, const ts_tensor_t *model)
{
    if (t->dtype != model->dtype || t->ndim != model->ndim)
        return 0;
    for (int d = 1; d < t->ndim; d++)
        if (t->shape[d] != model->shape[d])
            return 0;
    return 1;
}

/*
 * The rows of entry id's record v: the first dimension of its root tensor, or the first
 * dimension shared by every tensor of its root map. 0 and *rows, or TS_EINVAL (message set).
 */
static int record_rows(const ts_value_t *v, uint64_t id, int64_t *rows)
{
    const ts_tensor_t *t = ts_value_tensor(v);
    if (t != NULL) {
        if (t->ndim < 1)
            return ts__fail(TS_EINVAL, "entry %llu: a scalar tensor has no rows to re-slice",
                            (unsigned long long)id);
        *rows = t->shape[0];
        return 0;
    }
    if (ts_value_type(v) != TS_TYPE_MAP)
        return ts__fail(TS_EINVAL,
                        "entry %llu: only a tensor or a map of tensors has rows to re-slice",
                        (unsigned long long)id);
    int64_t n = -1;
    for (size_t i = 0; i < ts_value_len(v); i++) {
        t = ts_value_tensor(ts_map_value_at(v, i));
        if (t == NULL)
            continue;
        if (t->ndim < 1)
            return ts__fail(TS_EINVAL, "entry %llu: tensor '%s' is a scalar: it has no rows",
                            (unsigned long long)id, ts_map_key_at(v, i));
        if (n >= 0 && t->shape[0] != n)
            return ts__fail(
                TS_EINVAL, "entry %llu: tensor '%s' has %lld rows, the tensors before it %lld",
                (unsigned long long)id, ts_map_key_at(v, i), (long long)t->shape[0], (long long)n);
        n = t->shape[0];
    }
    if (n < 0)
        return ts__fail(TS_EINVAL, "entry %llu: a map without tensors has no rows to re-slice",
                        (unsigned long long)id);
    *rows = n;
    return 0;
}

/* Bytes per row of t (ndim >= 1): its element size times its trailing dimensions. */
static int row_size(const ts_tensor_t *t, size_t *out)
{
    size_t n = ts_dtype_size(t->dtype);
    for (int d = 1; d < t->ndim; d++)
        if (__builtin_mul_overflow(n, (size_t)t->shape[d], &n))
            return TS_EINVAL;
    *out = n;
    return 0;
}

/* A tensor value like t with cap rows, in fresh memory. */
static ts_value_t *alloc_rows(const ts_tensor_t *t, uint32_t cap)
{
    int64_t shape[TS_MAX_NDIM];
    memcpy(shape, t->shape, sizeof(shape));
    shape[0] = cap;
    return ts_tensor_alloc(t->dtype, t->ndim, shape);
}

/*
 * Start a batch of cap rows shaped like entry id's record v (whose rows record_rows checked):
 * the same tensors with cap rows, and a copy of v's other map values. 0, or TS_ENOMEM /
 * TS_EINVAL with the message set and nothing kept.
 */
static int asm_start(asm_batch *a, const ts_value_t *v, uint32_t cap, uint64_t id)
{
    const ts_tensor_t *t = ts_value_tensor(v);
    size_t n = t != NULL ? 1 : ts_value_len(v);
    int rc = 0;
    a->cols = ts__calloc(n, sizeof(col));
    if (a->cols == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    a->is_map = t == NULL;
    if (t != NULL) {
        a->out = alloc_rows(t, cap);
        a->cols[0].t = a->out;
        a->ncols = 1;
        rc = a->out == NULL ? TS_ENOMEM : row_size(t, &a->cols[0].row_size);
    } else {
        a->out = ts_map_new();
        rc = a->out == NULL ? TS_ENOMEM : 0;
        for (size_t i = 0; rc == 0 && i < n; i++) {
            const char *key = ts_map_key_at(v, i);
            const ts_value_t *child = ts_map_value_at(v, i);
            const ts_tensor_t *ct = ts_value_tensor(child);
            if (ts_map_get(a->out, key) != NULL) {
                rc = ts__fail(TS_EINVAL, "entry %llu: key '%s' appears twice",
                              (unsigned long long)id, key);
                break;
            }
            rc = ts_map_set(a->out, key, ct != NULL ? alloc_rows(ct, cap) : ts_value_clone(child));
            if (rc == 0 && ct != NULL) {
                col *k = &a->cols[a->ncols++];
                k->key = i;
                k->t = (ts_value_t *)ts_map_get(a->out, key);
                rc = row_size(ct, &k->row_size);
            }
        }
    }
    if (rc != 0) {
        asm_reset(a);
        return rc == TS_EINVAL ? rc : ts__fail(rc, NULL);
    }
    a->cap = cap;
    a->filled = 0;
    a->first_id = id;
    return 0;
}

/*
 * Check that entry id's record v has the tensors of the batch being built (the same keys,
 * dtypes and trailing dimensions). 0 or TS_EINVAL with the message set.
 */
static int asm_fits(const asm_batch *a, const ts_value_t *v, uint64_t id)
{
    if (!a->is_map) {
        const ts_tensor_t *t = ts_value_tensor(v);
        if (t == NULL || !same_layout(t, ts_value_tensor(a->out)))
            return ts__fail(TS_EINVAL,
                            "entry %llu: its tensor differs in dtype or trailing dimensions from "
                            "entry %llu's, in the same batch",
                            (unsigned long long)id, (unsigned long long)a->first_id);
        return 0;
    }
    size_t tensors = 0;
    for (size_t i = 0; ts_value_type(v) == TS_TYPE_MAP && i < ts_value_len(v); i++)
        tensors += ts_value_tensor(ts_map_value_at(v, i)) != NULL;
    if (ts_value_type(v) != TS_TYPE_MAP || tensors != a->ncols)
        return ts__fail(TS_EINVAL,
                        "entry %llu: its tensors are not those of entry %llu, in the same batch",
                        (unsigned long long)id, (unsigned long long)a->first_id);
    for (size_t k = 0; k < a->ncols; k++) {
        const char *key = ts_map_key_at(a->out, a->cols[k].key);
        const ts_tensor_t *t = ts_value_tensor(ts_map_get(v, key));
        if (t == NULL || !same_layout(t, ts_value_tensor(a->cols[k].t)))
            return ts__fail(TS_EINVAL,
                            "entry %llu: tensor '%s' is missing or differs in dtype or trailing "
                            "dimensions from entry %llu's, in the same batch",
                            (unsigned long long)id, key, (unsigned long long)a->first_id);
    }
    return 0;
}

/* Copy rows [start, start + k) of every tensor of v (which asm_fits) into the batch. */
static void asm_take(asm_batch *a, const ts_value_t *v, uint32_t start, uint32_t k)
{
    for (size_t i = 0; i < a->ncols; i++) {
        const col *cl = &a->cols[i];
        const ts_tensor_t *src =
            a->is_map ? ts_value_tensor(ts_map_get(v, ts_map_key_at(a->out, cl->key)))
                      : ts_value_tensor(v);
        const ts_tensor_t *dst = ts_value_tensor(cl->t);
        /* Both fit in memory already: these products cannot overflow. */
        if (cl->row_size > 0 && k > 0)
            memcpy((uint8_t *)dst->data + (size_t)a->filled * cl->row_size,
                   (const uint8_t *)src->data + (size_t)start * cl->row_size,
                   (size_t)k * cl->row_size);
    }
    a->filled += k;
}

/* The entry at pos is used up: move to the next one. */
static void cons_advance(ts_stream_consumer_t *s)
{
    s->pos++;
    s->off_set = 0;
}

/* Entry id was handed out whole (the caller reserved room in done). */
static void cons_done(ts_stream_consumer_t *s, uint64_t id)
{
    s->done[s->ndone++] = id;
    if (s->have_part && s->part_id == id)
        s->have_part = 0;
}

static void item_info(ts_stream_item_t *info, int marker, uint64_t tag, uint64_t first,
                      uint64_t last, uint64_t lost)
{
    if (info == NULL)
        return;
    info->end_of_epoch = marker;
    info->tag = tag;
    info->first_id = first;
    info->last_id = last;
    info->lost = lost;
}

/* Hand out the batch being built (as many rows as it holds). 0 or TS_ENOMEM (nothing changed). */
static int cons_hand_asm(ts_stream_consumer_t *s, ts_value_t **value, ts_stream_item_t *info)
{
    asm_batch *a = &s->a;
    if (ids_reserve(&s->done, &s->done_cap, s->ndone + a->nids) != 0)
        return ts__fail(TS_ENOMEM, NULL);
    if (a->filled < a->cap) /* a marker or a re-slice of the rest of an entry came first */
        for (size_t i = 0; i < a->ncols; i++)
            ts_value_tensor_set_rows(a->cols[i].t, a->filled);
    for (size_t i = 0; i < a->nids; i++)
        cons_done(s, a->ids[i]);
    if (a->part_rows > 0) {
        const ts__stream_head *h = batch_head(s->batch, s->pos);
        if (!s->have_part || s->part_id != h->id) {
            s->have_part = 1;
            s->part_id = h->id;
            s->part_acked = h->rows_done;
        }
        s->part_rows = s->off;
    }
    *value = a->out;
    item_info(info, 0, 0, a->first_id, a->last_id, s->lost);
    a->out = NULL;
    asm_reset(a);
    return 0;
}

/*
 * The smallest id still open when the batch is used up: the entries copied into the batch being
 * built and the partly handed out one (UINT64_MAX when none).
 */
static uint64_t cons_min_open(const ts_stream_consumer_t *s)
{
    uint64_t m = UINT64_MAX;
    for (size_t i = 0; i < s->a.nids; i++)
        m = s->a.ids[i] < m ? s->a.ids[i] : m;
    if (s->have_part && s->part_id < m)
        m = s->part_id;
    return m;
}

/*
 * Read the next entries (the batch used up), acknowledging on the way the done entries below
 * every open one. 0, or the read's error.
 */
static int cons_fill(ts_stream_consumer_t *s, uint32_t wait_ms)
{
    uint64_t open = cons_min_open(s);
    uint64_t ack = 0;
    for (size_t i = 0; i < s->ndone; i++)
        if (s->done[i] < open && s->done[i] > ack)
            ack = s->done[i];
    ts_stream_batch_free(s->batch);
    s->batch = NULL;
    s->pos = 0;
    s->off_set = 0;
    ts_stream_batch_t *b;
    int rc =
        ts_stream_read(s->c, s->name, s->group, s->member, ack, s->o.prefetch, (int)wait_ms, &b);
    if (rc != 0) {
        /*
         * Without an answer the read may still have handed entries to this member: a join
         * marks them for redelivery. Refusals of the server change nothing.
         */
        if (rc != TS_EINVAL && rc != TS_ENOENT && rc != TS_EDEADLK && rc != TS_ENAMETOOLONG)
            s->rejoin = 1;
        return rc;
    }
    size_t keep = 0;
    for (size_t i = 0; i < s->ndone; i++)
        if (s->done[i] > ack)
            s->done[keep++] = s->done[i];
    s->ndone = keep;
    s->batch = b;
    s->lost = ts_stream_batch_lost(b);
    return 0;
}

/*
 * Acknowledge the done entries (at least one) in id ranges that hold no open id. 0 or the first
 * error (what was not acknowledged stays in done).
 */
static int cons_ack_done(ts_stream_consumer_t *s)
{
    int rc = 0;
    size_t nopen = s->a.nids + (s->have_part ? 1 : 0);
    size_t nb = ts_stream_batch_count(s->batch);
    nopen += nb > s->pos ? nb - s->pos : 0;
    uint64_t *open = ts__malloc((nopen > 0 ? nopen : 1) * sizeof(uint64_t));
    if (open == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    size_t n = 0;
    for (size_t i = 0; i < s->a.nids; i++)
        open[n++] = s->a.ids[i];
    if (s->have_part)
        open[n++] = s->part_id;
    for (size_t i = s->pos; i < nb; i++)
        open[n++] = s->batch->tail->e[i].id;
    qsort(open, n, sizeof(uint64_t), cmp_u64);
    qsort(s->done, s->ndone, sizeof(uint64_t), cmp_u64);
    size_t i = 0, o = 0, keep = 0;
    while (i < s->ndone) {
        size_t j = i;
        while (o < n && open[o] < s->done[i])
            o++;
        if (rc != 0 || (o < n && open[o] == s->done[i])) {
            s->done[keep++] = s->done[i++]; /* kept: never acknowledge an open id */
            continue;
        }
        /* Extend the range over the next done ids while no open id lies in between. */
        while (j + 1 < s->ndone && (o >= n || open[o] > s->done[j + 1]))
            j++;
        rc = ts_stream_ack(s->c, s->name, s->group, s->member, s->done[i], s->done[j], 0, NULL);
        if (rc != 0)
            continue; /* this range and the rest stay to be acknowledged */
        i = j + 1;
    }
    s->ndone = keep;
    ts__free(open);
    return rc;
}

/*
 * Acknowledge every done entry and the rows handed out of part. 0 or the first error (what was
 * not acknowledged stays to be).
 */
static int cons_commit(ts_stream_consumer_t *s)
{
    int rc = s->ndone > 0 ? cons_ack_done(s) : 0;
    if (rc == 0 && s->have_part && s->part_rows > s->part_acked) {
        rc = ts_stream_ack(s->c, s->name, s->group, s->member, s->part_id, s->part_id, s->part_rows,
                           NULL);
        if (rc == 0)
            s->part_acked = s->part_rows;
    }
    return rc;
}

/*
 * Join again after a read went unanswered: acknowledge what was handed out, then drop what was
 * read and not handed out (the join marks it for redelivery, its used rows included).
 */
static int cons_rejoin(ts_stream_consumer_t *s)
{
    int rc = cons_commit(s);
    if (rc != 0)
        return rc;
    rc = ts_stream_join(s->c, s->name, s->group, s->member, s->o.start, s->o.lease_ms, NULL);
    if (rc != 0)
        return rc;
    ts_stream_batch_free(s->batch);
    s->batch = NULL;
    s->pos = 0;
    s->off_set = 0;
    asm_reset(&s->a);
    s->have_part = 0;
    s->rejoin = 0;
    return 0;
}

int ts_stream_consumer_open(ts_stream_consumer_t **out, ts_client_t *c, const char *name,
                            const char *group, const char *member,
                            const ts_stream_consumer_options_t *opts)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if (out == NULL)
        return ts__fail(TS_EINVAL, "no output");
    ts_stream_consumer_options_t o;
    ts_stream_consumer_options_init(&o);
    if (opts != NULL)
        o = *opts;
    if (o.prefetch < 1 || o.prefetch > TS_STREAM_READ_MAX)
        return ts__fail(TS_EINVAL, "prefetch %u: expected 1 to %d entries", o.prefetch,
                        TS_STREAM_READ_MAX);
    if ((rc = check_helper_timeout("timeout_ms", o.timeout_ms)) != 0)
        return rc;
    rc = ts_stream_join(c, name, group, member, o.start, o.lease_ms, NULL);
    if (rc != 0)
        return rc;
    ts_stream_consumer_t *s = ts__calloc(1, sizeof(*s));
    if (s == NULL)
        return ts__fail(TS_ENOMEM, NULL);
    s->name = ts__strndup(name, strlen(name));
    s->group = ts__strndup(group, strlen(group));
    s->member = ts__strndup(member, strlen(member));
    if (s->name == NULL || s->group == NULL || s->member == NULL) {
        ts_stream_consumer_close(s, 0);
        return ts__fail(TS_ENOMEM, NULL);
    }
    s->c = c;
    s->o = o;
    *out = s;
    return 0;
}

/* ms of one read's wait: at most half the lease (see TS__STREAM_WAIT_LEASE_DIV). */
static uint32_t cons_wait_cap(const ts_stream_consumer_t *s)
{
    uint32_t lease = s->o.lease_ms > 0 ? (uint32_t)s->o.lease_ms : TS_STREAM_DEFAULT_LEASE_MS;
    uint32_t cap = lease / TS__STREAM_WAIT_LEASE_DIV;
    return cap > 0 ? cap : 1;
}

int ts_stream_consumer_next(ts_stream_consumer_t *s, ts_value_t **value, ts_stream_item_t *info)
{
    if (s == NULL || value == NULL)
        return ts__fail(TS_EINVAL, "no consumer or no output");
    int rc = ts__api_check_call(s->c, 1);
    if (rc != 0)
        return rc;
    int infinite;
    uint64_t deadline_ns;
    helper_deadline(s->c, s->o.timeout_ms, &infinite, &deadline_ns);
    uint32_t cap = cons_wait_cap(s);
    int reads = 0;
    for (;;) {
        if (s->rejoin && (rc = cons_rejoin(s)) != 0)
            return rc;
        if (s->pos >= ts_stream_batch_count(s->batch)) {
            uint32_t wait = infinite ? cap : ms_left(deadline_ns, cap);
            if (reads > 0 && wait == 0)
                return ts__fail(TS_ETIMEDOUT, "no entry on stream '%s' within %d ms", s->name,
                                s->o.timeout_ms == TS_TIMEOUT_DEFAULT
                                    ? s->c->opts.request_timeout_ms
                                    : s->o.timeout_ms);
            if ((rc = cons_fill(s, wait)) != 0)
                return rc;
            reads++;
            continue;
        }
        const ts__stream_head *h = &s->batch->tail->e[s->pos];
        if (!s->off_set) {
            s->off = h->rows_done;
            s->off_set = 1;
        }
        if (h->kind == TS_STREAM_ENTRY_MARKER) {
            if (s->a.out != NULL) /* the rows before the marker first */
                return cons_hand_asm(s, value, info);
            if (ids_reserve(&s->done, &s->done_cap, s->ndone + 1) != 0)
                return ts__fail(TS_ENOMEM, NULL);
            cons_done(s, h->id);
            item_info(info, 1, h->tag, h->id, h->id, s->lost);
            *value = NULL;
            cons_advance(s);
            return 0;
        }
        ts_value_t *v = s->batch->items->items[s->pos];
        uint32_t b = s->o.batch_rows;
        int64_t rows = 0;
        int whole = b == 0 && s->off == 0;
        if (!whole && record_rows(v, h->id, &rows) != 0) {
            if (b > 0)
                return TS_EINVAL; /* with record_rows' message */
            /* Rows recorded as used of a record that has none: it goes whole. */
            ts__set_last_error(NULL, 0);
            whole = 1;
        }
        if (!whole && (int64_t)s->off >= rows) {
            /* Its rows were all used before (recorded with STREAM_ACK rows): nothing to hand. */
            if (ids_reserve(&s->done, &s->done_cap, s->ndone + 1) != 0)
                return ts__fail(TS_ENOMEM, NULL);
            cons_done(s, h->id);
            cons_advance(s);
            continue;
        }
        int64_t avail = rows - (int64_t)s->off;
        if (whole || (s->a.out == NULL && s->off == 0 && avail == (int64_t)b)) {
            /* The entry as it was appended: its decoded record is handed over, not copied. */
            if (ids_reserve(&s->done, &s->done_cap, s->ndone + 1) != 0)
                return ts__fail(TS_ENOMEM, NULL);
            s->batch->items->items[s->pos] = NULL;
            cons_done(s, h->id);
            item_info(info, 0, 0, h->id, h->id, s->lost);
            *value = v;
            cons_advance(s);
            return 0;
        }
        if (avail > UINT32_MAX)
            return ts__fail(TS_EINVAL, "entry %llu: %lld rows are more than a batch can hold",
                            (unsigned long long)h->id, (long long)avail);
        uint32_t want = b > 0 ? b : (uint32_t)avail;
        if (ids_reserve(&s->a.ids, &s->a.ids_cap, s->a.nids + 1) != 0)
            return ts__fail(TS_ENOMEM, NULL);
        if (s->a.out != NULL)
            rc = asm_fits(&s->a, v, h->id);
        else
            rc = asm_start(&s->a, v, want, h->id);
        if (rc != 0)
            return rc;
        uint32_t room = s->a.cap - s->a.filled;
        uint32_t k = (uint64_t)avail < room ? (uint32_t)avail : room;
        asm_take(&s->a, v, s->off, k);
        s->off += k;
        s->a.last_id = h->id;
        if ((int64_t)s->off >= rows) {
            s->a.ids[s->a.nids++] = h->id;
            s->a.part_rows = 0;
            cons_advance(s);
        } else {
            s->a.part_rows += k;
        }
        if (s->a.filled == s->a.cap)
            return cons_hand_asm(s, value, info);
    }
}

int ts_stream_consumer_commit(ts_stream_consumer_t *s)
{
    if (s == NULL)
        return ts__fail(TS_EINVAL, "no consumer");
    int rc = ts__api_check_call(s->c, 1);
    return rc != 0 ? rc : cons_commit(s);
}

void ts_stream_consumer_close(ts_stream_consumer_t *s, int leave)
{
    if (s == NULL)
        return;
    if (s->c != NULL && ts__api_check_call(s->c, 1) == 0) {
        /* Best effort: what is not acknowledged is handed out again after a join. */
        cons_commit(s);
        if (leave)
            ts_stream_leave(s->c, s->name, s->group, s->member, NULL);
    }
    ts_stream_batch_free(s->batch);
    asm_reset(&s->a);
    ts__free(s->a.ids);
    ts__free(s->done);
    ts__free(s->name);
    ts__free(s->group);
    ts__free(s->member);
    ts__free(s);
}
