/*
 * Reply bodies into results (on the I/O thread, or on a blocking caller reading its own reply),
 * and the objects replies produce: ts_items_t (stream entries included: internal.h) and
 * ts_bin_list_t. Every body layout is decoded by src/msg.c's strict decoders (which check every
 * length against the body before it is used); this file only turns decoded bodies into results.
 */
#include "internal.h"

#include "msg.h"

#include <assert.h>
#include <stdlib.h>

void ts__body_free(uint8_t *body, size_t len)
{
    ts__free_aligned(body, len);
}

/* A bin state body into res (PUT, APPEND, DELETE, LISTEN and WAIT, WAIT's TIMEOUT too). */
int ts__reply_bin_state(ts__req *r, const uint8_t *body, size_t len)
{
    ts__msg_bin_state m;
    if (ts__msg_bin_state_decode(body, len, &m) != 0)
        return TS_EPROTO;
    r->res.version = m.version;
    r->res.n_items = m.n_items;
    r->have_state = 1;
    return 0;
}

/*
 * The steps every record-list parser below shares (ITEMS, ENTRIES, SAMPLES, MGET), kept in one
 * place so that they cannot drift apart in how they free a body or tell a corrupt record from a
 * failed allocation.
 *
 * items_new: the zeroed result block of `size` bytes and the reference-counted buffer that takes
 * over body. On failure frees whatever was made, body included, and returns TS_ENOMEM.
 */
static int items_new(uint8_t *body, size_t len, size_t size, ts_items_t **items, ts__rbuf **buf)
{
    *items = ts__calloc(1, size);
    *buf = ts__rbuf_new(body, len, NULL);
    if (*items == NULL || *buf == NULL) {
        ts__free(*items);
        ts__free(*buf);
        ts__body_free(body, len);
        return TS_ENOMEM;
    }
    return 0;
}

/*
 * Decodes the record at [off, off + rec_len) of buf's data in place into *v. When decoding fails
 * the record is validated again to tell the two causes apart: a valid record means an allocation
 * failed (TS_ENOMEM), an invalid one that the server sent a corrupt body (TS_EPROTO).
 */
static int record_decode(ts__rbuf *buf, size_t off, size_t rec_len, ts_value_t **v)
{
    *v = ts__record_decode(buf, off, rec_len, TS_MAX_DEPTH, TS_MAX_NDIM);
    if (*v != NULL)
        return 0;
    return ts__record_validate(buf->data + off, rec_len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) == 0
               ? TS_ENOMEM
               : TS_EPROTO;
}

/* Drops the parser's reference to buf (the decoded trees keep it alive), then hands items to
 * *out when rc is 0, or frees items and returns rc. */
static int items_done(ts_items_t *items, ts__rbuf *buf, int rc, ts_items_t **out)
{
    ts__rbuf_unref(buf);
    if (rc != 0) {
        ts_items_free(items);
        return rc;
    }
    *out = items;
    return 0;
}

/*
 * Parse a TS_ITEMS body: decode every item in place (tensors point into body). Takes over body
 * in every case. Returns 0 and *out, or TS_EPROTO / TS_ENOMEM.
 */
static int parse_items(uint8_t *body, size_t len, ts_items_t **out)
{
    ts__msg_items m;
    if (ts__msg_items_decode(body, len, &m) != 0) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    /* The decoder found every item's length inside the body: n_items is bounded by len / 8. */
    ts_items_t *items;
    ts__rbuf *buf;
    if (items_new(body, len, sizeof(*items) + (size_t)m.n_items * sizeof(ts_value_t *), &items,
                  &buf) != 0)
        return TS_ENOMEM;
    items->version = m.version;
    items->remaining = m.remaining;
    int rc = 0;
    ts__msg_items_iter it;
    size_t off, rec_len;
    ts__msg_items_iter_init(&m, &it);
    while (rc == 0 && ts__msg_items_next(&m, &it, &off, &rec_len)) {
        ts_value_t *v;
        if ((rc = record_decode(buf, off, rec_len, &v)) != 0)
            break;
        items->items[items->count++] = v;
    }
    return items_done(items, buf, rc, out);
}

/*
 * Parse an ENTRIES body (STREAM_READ, STREAM_RANGE) into the ts_items_t layout internal.h
 * describes: every record validated and decoded in place like an ITEMS record (its tensors point
 * into body), markers as NULL, the heads after the record pointers. Takes over body in every
 * case. Returns 0 and *out, or TS_EPROTO / TS_ENOMEM.
 */
static int parse_entries(uint8_t *body, size_t len, ts_items_t **out)
{
    ts__msg_stream_entries m;
    if (ts__msg_stream_entries_decode(body, len, &m) != 0) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    /* The decoder bounds n by TS_STREAM_MAX_READ: these sizes cannot overflow. */
    size_t n = m.n;
    size_t size = sizeof(ts_items_t) + n * sizeof(ts_value_t *) + sizeof(ts__stream_tail) +
                  n * sizeof(ts__stream_head);
    ts_items_t *items;
    ts__rbuf *buf;
    if (items_new(body, len, size, &items, &buf) != 0)
        return TS_ENOMEM;
    items->version = m.last_id;
    items->remaining = m.n;
    ts__stream_tail *tail = ts__items_stream_tail(items);
    tail->first_id = m.first_id;
    tail->last_id = m.last_id;
    tail->lost = m.lost;
    int rc = 0;
    ts__msg_stream_entries_iter it;
    ts__msg_stream_entry e;
    ts__msg_stream_entries_iter_init(&m, &it);
    while (rc == 0 && ts__msg_stream_entries_next(&m, &it, &e)) {
        ts__stream_head *h = &tail->e[items->count];
        h->id = e.id;
        h->tag = e.tag;
        h->rows_done = e.rows_done;
        h->deliveries = e.deliveries;
        h->kind = e.kind;
        h->flags = e.flags;
        ts_value_t *v = NULL;
        if (e.kind == TS_STREAM_ENTRY_RECORD) {
            size_t off = (size_t)(e.record - body);
            if ((rc = record_decode(buf, off, (size_t)e.len, &v)) != 0)
                break;
        }
        items->items[items->count++] = v;
    }
    return items_done(items, buf, rc, out);
}

/*
 * Parse a SAMPLES body (TABLE_SAMPLE) into the ts_items_t layout internal.h describes: every
 * record validated and decoded in place, the heads after the record pointers. Takes over body in
 * every case. Returns 0 and *out, or TS_EPROTO / TS_ENOMEM.
 */
static int parse_samples(uint8_t *body, size_t len, ts_items_t **out)
{
    ts__msg_table_samples m;
    if (ts__msg_table_samples_decode(body, len, &m) != 0) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    /* The decoder bounds n by TS_TABLE_MAX_SAMPLE: these sizes cannot overflow. */
    size_t n = m.n;
    size_t size = sizeof(ts_items_t) + n * sizeof(ts_value_t *) + sizeof(ts__table_tail) +
                  n * sizeof(ts__table_head);
    ts_items_t *items;
    ts__rbuf *buf;
    if (items_new(body, len, size, &items, &buf) != 0)
        return TS_ENOMEM;
    items->version = m.size;
    items->remaining = m.n;
    ts__table_tail *tail = ts__items_table_tail(items);
    tail->size = m.size;
    int rc = 0;
    for (uint32_t i = 0; i < m.n; i++) {
        ts__msg_table_sample e;
        ts__msg_table_sample_get(&m, i, &e);
        ts__table_head *h = &tail->e[i];
        h->key = e.key;
        h->age_ms = e.age_ms;
        h->probability = e.probability;
        h->times_sampled = e.times_sampled;
        size_t off = (size_t)(e.record - body);
        ts_value_t *v;
        if ((rc = record_decode(buf, off, (size_t)e.len, &v)) != 0)
            break;
        items->items[items->count++] = v;
    }
    return items_done(items, buf, rc, out);
}

static int cmp_bins(const void *a, const void *b)
{
    return strcmp(((const ts_bin_info_t *)a)->name, ((const ts_bin_info_t *)b)->name);
}

/* Parse a LIST body into one allocation (list, entries, names). 0, TS_EPROTO or TS_ENOMEM. */
static int parse_list(const uint8_t *body, size_t len, ts_bin_list_t **out)
{
    ts__msg_list m;
    if (ts__msg_list_decode(body, len, &m) != 0)
        return TS_EPROTO;
    /* First pass: add up the name bytes (the decoder checked every entry). */
    ts__msg_list_iter it = {0, 0};
    ts__msg_list_entry e;
    size_t names = 0;
    while (ts__msg_list_next(&m, &it, &e))
        names += e.name_len + 1;
    size_t head = sizeof(ts_bin_list_t) + (size_t)m.n * sizeof(ts_bin_info_t);
    ts_bin_list_t *list = ts__malloc(head + names);
    if (list == NULL)
        return TS_ENOMEM;
    list->count = m.n;
    list->bins = (ts_bin_info_t *)(list + 1);
    char *strs = (char *)list + head;
    it = (ts__msg_list_iter){0, 0};
    for (ts_bin_info_t *b = list->bins; ts__msg_list_next(&m, &it, &e); b++) {
        memcpy(strs, e.name, e.name_len);
        strs[e.name_len] = '\0';
        b->name = strs;
        strs += e.name_len + 1;
        b->n_items = e.n_items;
        b->bytes = e.bytes;
        b->version = e.version;
    }
    if (m.n > 1)
        qsort(list->bins, m.n, sizeof(ts_bin_info_t), cmp_bins);
    *out = list;
    return 0;
}

/* Decode a STATS body (a record) into a value tree. Takes over body. */
static int parse_stats(uint8_t *body, size_t len, ts_value_t **out)
{
    if (ts__msg_record_decode(body, len) != 0) { /* an empty body has no buffer at all */
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    ts__rbuf *buf = ts__rbuf_new(body, len, NULL);
    if (buf == NULL) {
        ts__body_free(body, len);
        return TS_ENOMEM;
    }
    ts_value_t *v;
    int rc = record_decode(buf, 0, len, &v);
    ts__rbuf_unref(buf);
    if (rc == 0)
        *out = v;
    return rc;
}

/*
 * Parse an MGET body: every found bin's records decoded in place (into one ts_items_t, see
 * internal.h), a head per bin after them. Takes over body in every case.
 */
static int parse_mget(uint8_t *body, size_t len, ts_items_t **out)
{
    ts__msg_mget_rep m;
    if (ts__msg_mget_rep_decode(body, len, &m) != 0) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    /* The decoder checked every block: records are bounded by len / 8. */
    size_t total = 0;
    for (uint32_t i = 0; i < m.n; i++) {
        int found;
        ts__msg_items it;
        ts__msg_mget_rep_get(&m, i, &found, &it);
        total += found ? it.n_items : 0;
    }
    ts_items_t *items;
    ts__rbuf *buf;
    if (items_new(body, len,
                  sizeof(*items) + total * sizeof(ts_value_t *) +
                      (size_t)m.n * sizeof(ts__mget_head),
                  &items, &buf) != 0)
        return TS_ENOMEM;
    /* The heads follow items[total]; count reaches total only when every record is decoded. */
    ts__mget_head *heads = (ts__mget_head *)(void *)(items->items + total);
    items->remaining = m.n;
    int rc = 0;
    for (uint32_t i = 0; rc == 0 && i < m.n; i++) {
        int found;
        ts__msg_items it;
        ts__msg_mget_rep_get(&m, i, &found, &it);
        heads[i].found = found;
        if (!found)
            continue;
        heads[i].version = it.version;
        heads[i].n_items = it.n_items;
        heads[i].remaining = it.remaining;
        size_t base = (size_t)(it.body - body), off, rec_len;
        ts__msg_items_iter iter;
        ts__msg_items_iter_init(&it, &iter);
        while (rc == 0 && ts__msg_items_next(&it, &iter, &off, &rec_len)) {
            ts_value_t *v;
            if ((rc = record_decode(buf, base + off, rec_len, &v)) == 0)
                items->items[items->count++] = v;
        }
    }
    return items_done(items, buf, rc, out);
}

int ts__reply_keeps_body(uint8_t op)
{
    ts__msg_kind k = ts__msg_reply_kind(op, TS_ST_OK);
    if (k == TS_MSG_MGET_REP) /* its records too point into the body */
        return 1;
    return k == TS_MSG_ITEMS || k == TS_MSG_RECORD || k == TS_MSG_STREAM_ENTRIES ||
           k == TS_MSG_TABLE_SAMPLES;
}

int ts__reply_parse(ts__req *r, uint8_t *body, size_t len)
{
    int rc;
    switch (ts__msg_reply_kind(r->op, TS_ST_OK)) {
    case TS_MSG_ITEMS:
        rc = parse_items(body, len, &r->res.items);
        if (rc == 0) {
            r->res.version = r->res.items->version;
            r->res.n_items = r->res.items->remaining;
        }
        return rc;
    case TS_MSG_RECORD:
        return parse_stats(body, len, &r->res.value);
    case TS_MSG_MGET_REP:
        return parse_mget(body, len, &r->res.items);
    case TS_MSG_STREAM_ENTRIES:
        rc = parse_entries(body, len, &r->res.items);
        if (rc == 0)
            r->res.version = r->res.items->version;
        return rc;
    case TS_MSG_TABLE_SAMPLES:
        return parse_samples(body, len, &r->res.items);
    default:
        rc = ts__reply_parse_view(r, body, len);
        ts__body_free(body, len);
        return rc;
    }
}

int ts__reply_wrong_shard(ts__req *r, const uint8_t *body, size_t len)
{
    ts__msg_wrong_shard m;
    if (ts__msg_wrong_shard_decode(body, len, &m) != 0)
        return TS_EPROTO;
    r->have_ws = 1;
    r->ws_slot = m.slot;
    r->ws_owner = m.owner;
    r->ws_epoch = m.epoch;
    ts__free(r->ws_addr);
    r->ws_addr = m.addr_len > 0 ? ts__strndup((const char *)m.addr, m.addr_len) : NULL;
    ts__free(r->msg);
    r->msg = m.msg_len > 0 ? ts__strndup(m.msg, m.msg_len) : NULL;
    /* Without memory for the address the request fails with the error instead of redirecting. */
    if (m.addr_len > 0 && r->ws_addr == NULL)
        r->have_ws = 0;
    return 0;
}

int ts__reply_parse_view(ts__req *r, const uint8_t *body, size_t len)
{
    assert(!ts__reply_keeps_body(r->op));
    switch (ts__msg_reply_kind(r->op, TS_ST_OK)) {
    case TS_MSG_LIST_REP:
        return parse_list(body, len, &r->res.bins);
    case TS_MSG_BIN_STATE:
        return ts__reply_bin_state(r, body, len);
    case TS_MSG_HELLO_REP: {
        ts__msg_hello_rep m;
        if (ts__msg_hello_rep_decode(body, len, &m) != 0 || m.version != TS_PROTO_VERSION)
            return TS_EPROTO;
        r->hello_flags = m.flags;
        r->hello_max_body = m.max_body;
        if (m.proof != NULL)
            memcpy(r->hello_proof, m.proof, TS_MSG_TOKEN_PROOF_SIZE);
        return 0;
    }
    case TS_MSG_AUTH_NONCE: {
        ts__msg_auth_nonce m;
        if (ts__msg_auth_nonce_decode(body, len, &m) != 0)
            return TS_EPROTO;
        memcpy(r->hello_proof, m.nonce, TS_MSG_AUTH_NONCE_SIZE);
        return 0;
    }
    case TS_MSG_EMPTY:
        return ts__msg_empty_decode(body, len);
    case TS_MSG_ADD_STATE:
        return ts__msg_add_state_decode(body, len, &r->stream.add) != 0 ? TS_EPROTO : 0;
    case TS_MSG_BARRIER_STATE:
        return ts__msg_barrier_state_decode(body, len, &r->stream.barrier) != 0 ? TS_EPROTO : 0;
    case TS_MSG_STREAM_STATE:
        return ts__msg_stream_state_decode(body, len, &r->stream.state) != 0 ? TS_EPROTO : 0;
    case TS_MSG_STREAM_APPEND_STATE:
        return ts__msg_stream_append_state_decode(body, len, &r->stream.append) != 0 ? TS_EPROTO
                                                                                     : 0;
    case TS_MSG_STREAM_JOIN_STATE:
        return ts__msg_stream_join_state_decode(body, len, &r->stream.join) != 0 ? TS_EPROTO : 0;
    case TS_MSG_STREAM_ACK_STATE:
        return ts__msg_stream_ack_state_decode(body, len, &r->stream.ack) != 0 ? TS_EPROTO : 0;
    case TS_MSG_TABLE_STATE:
        return ts__msg_table_state_decode(body, len, &r->stream.table) != 0 ? TS_EPROTO : 0;
    case TS_MSG_SVC_STATE: /* SVC_REGISTER (service.c) */
        return ts__msg_svc_state_decode(body, len, &r->stream.svc) != 0 ? TS_EPROTO : 0;
    case TS_MSG_SHARD_MAP: {
        /* The daemon's map (cluster.c adopts it); a daemon that is not sharded has none. */
        ts__msg_shard_map m;
        if (ts__msg_shard_map_decode(body, len, &m) != 0)
            return TS_EPROTO;
        r->shard_self = m.self;
        if (m.n_shards == 0)
            return 0;
        int rc = ts__shard_map_from_msg(&m, &r->shard_map);
        return rc == TS_ENOMEM ? TS_ENOMEM : rc != 0 ? TS_EPROTO : 0;
    }
    default: /* no request of ours has another opcode */
        return TS_EPROTO;
    }
}

/* ---------------------------------------------------------------------------------------------
 * Public accessors
 */

size_t ts_items_count(const ts_items_t *items)
{
    return items == NULL ? 0 : items->count;
}

const ts_value_t *ts_items_at(const ts_items_t *items, size_t i)
{
    if (items == NULL || i >= items->count)
        return NULL;
    return items->items[i];
}

uint64_t ts_items_version(const ts_items_t *items)
{
    return items == NULL ? 0 : items->version;
}

uint32_t ts_items_remaining(const ts_items_t *items)
{
    return items == NULL ? 0 : items->remaining;
}

void ts_items_free(ts_items_t *items)
{
    if (items == NULL)
        return;
    for (size_t i = 0; i < items->count; i++)
        ts__record_tree_free(items->items[i]);
    ts__free(items);
}

void ts_bin_list_free(ts_bin_list_t *list)
{
    ts__free(list);
}
