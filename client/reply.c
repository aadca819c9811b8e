/*
 * Reply parsing (I/O thread) and the objects replies produce: ts_items_t and ts_bin_list_t.
 * Every length read from the wire is checked against the body before it is used.
 */
#include "internal.h"

#include <assert.h>
#include <stdlib.h>

struct ts_items_s {
    size_t count;
    uint64_t version;
    uint32_t remaining;
    ts_value_t *items[]; /* decoded trees; each holds a reference on the receive buffer */
};

void ts__body_free(uint8_t *body, size_t len)
{
    ts__free_aligned(body, len);
}

int ts__parse_bin_state(const uint8_t *body, size_t len, ts_result_t *res)
{
    ts__rd r;
    uint64_t version;
    uint32_t n, zero;
    ts__rd_init(&r, body, len);
    if (ts__rd_u64(&r, &version) != 0 || ts__rd_u32(&r, &n) != 0 || ts__rd_u32(&r, &zero) != 0 ||
        r.left != 0)
        return TS_EPROTO;
    res->version = version;
    res->n_items = n;
    return 0;
}

/*
 * Parse a TS_ITEMS body: decode every item in place (tensors point into body). Takes over body
 * in every case. Returns 0 and *out, or TS_EPROTO / TS_ENOMEM.
 */
static int parse_items(uint8_t *body, size_t len, ts_items_t **out)
{
    ts__rd r;
    uint64_t version;
    uint32_t n, remaining;
    ts__rd_init(&r, body, len);
    if (ts__rd_u64(&r, &version) != 0 || ts__rd_u32(&r, &n) != 0 ||
        ts__rd_u32(&r, &remaining) != 0) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    /* Each item needs at least its 8-byte length: bound n before allocating. */
    if ((uint64_t)n > (len - 16) / 8 || ts__items_head_size(n) > len) {
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    ts_items_t *items = ts__calloc(1, sizeof(*items) + (size_t)n * sizeof(ts_value_t *));
    ts__rbuf *buf = ts__rbuf_new(body, len, NULL);
    if (items == NULL || buf == NULL) {
        ts__free(items);
        ts__free(buf);
        ts__body_free(body, len);
        return TS_ENOMEM;
    }
    items->version = version;
    items->remaining = remaining;
    int rc = 0;
    uint64_t off = ts__items_head_size(n);
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        uint64_t item_len = ts__get_u64le(body + 16 + 8 * (size_t)i);
        uint64_t end, next;
        if (__builtin_add_overflow(off, item_len, &end) || end > len ||
            ts__align_up_checked(end, TS__ALIGN, &next) != 0 || next > len) {
            rc = TS_EPROTO;
            break;
        }
        items->items[i] =
            ts__record_decode(buf, (size_t)off, (size_t)item_len, TS_MAX_DEPTH, TS_MAX_NDIM);
        if (items->items[i] == NULL) {
            rc = ts__record_validate(body + off, (size_t)item_len, TS_MAX_DEPTH, TS_MAX_NDIM,
                                     NULL) == 0
                     ? TS_ENOMEM
                     : TS_EPROTO;
            break;
        }
        items->count++;
        off = next;
    }
    /* The body ends with the padding of its last item (or of the head): nothing may follow. */
    if (rc == 0 && off != len)
        rc = TS_EPROTO;
    ts__rbuf_unref(buf); /* the decoded trees keep it alive */
    if (rc != 0) {
        ts_items_free(items);
        return rc;
    }
    *out = items;
    return 0;
}

static int cmp_bins(const void *a, const void *b)
{
    return strcmp(((const ts_bin_info_t *)a)->name, ((const ts_bin_info_t *)b)->name);
}

/* Parse a LIST body into one allocation (list, entries, names). 0, TS_EPROTO or TS_ENOMEM. */
static int parse_list(const uint8_t *body, size_t len, ts_bin_list_t **out)
{
    enum { ENTRY_MIN = 1 + 4 + 8 + 8 }; /* bytes of an entry with an empty name */
    ts__rd r;
    uint32_t n, zero;
    ts__rd_init(&r, body, len);
    if (ts__rd_u32(&r, &n) != 0 || ts__rd_u32(&r, &zero) != 0 || (uint64_t)n * ENTRY_MIN > r.left)
        return TS_EPROTO;
    /* First pass: check every entry and add up the name bytes. */
    ts__rd scan = r;
    size_t names = 0;
    for (uint32_t i = 0; i < n; i++) {
        const char *name;
        size_t nl;
        if (ts__rd_name(&scan, &name, &nl) != 0 || ts__rd_bytes(&scan, 20) == NULL)
            return TS_EPROTO;
        names += nl + 1;
    }
    if (scan.left != 0)
        return TS_EPROTO; /* bytes after the last entry */
    size_t head = sizeof(ts_bin_list_t) + (size_t)n * sizeof(ts_bin_info_t);
    ts_bin_list_t *list = ts__malloc(head + names);
    if (list == NULL)
        return TS_ENOMEM;
    list->count = n;
    list->bins = (ts_bin_info_t *)(list + 1);
    char *strs = (char *)list + head;
    for (uint32_t i = 0; i < n; i++) {
        const char *name;
        size_t nl;
        ts__rd_name(&r, &name, &nl);
        memcpy(strs, name, nl);
        strs[nl] = '\0';
        ts_bin_info_t *b = &list->bins[i];
        b->name = strs;
        strs += nl + 1;
        ts__rd_u32(&r, &b->n_items);
        ts__rd_u64(&r, &b->bytes);
        ts__rd_u64(&r, &b->version);
    }
    if (n > 1)
        qsort(list->bins, n, sizeof(ts_bin_info_t), cmp_bins);
    *out = list;
    return 0;
}

/* Decode a STATS body (a record) into a value tree. Takes over body. */
static int parse_stats(uint8_t *body, size_t len, ts_value_t **out)
{
    if (len < TS_REC_HDR_SIZE) { /* no record; an empty body has no buffer at all */
        ts__body_free(body, len);
        return TS_EPROTO;
    }
    ts__rbuf *buf = ts__rbuf_new(body, len, NULL);
    if (buf == NULL) {
        ts__body_free(body, len);
        return TS_ENOMEM;
    }
    ts_value_t *v = ts__record_decode(buf, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    int rc = 0;
    if (v == NULL)
        rc = ts__record_validate(body, len, TS_MAX_DEPTH, TS_MAX_NDIM, NULL) == 0 ? TS_ENOMEM
                                                                                  : TS_EPROTO;
    ts__rbuf_unref(buf);
    if (rc == 0)
        *out = v;
    return rc;
}

int ts__reply_keeps_body(uint8_t op)
{
    return op == TS_OP_GET || op == TS_OP_PEEK || op == TS_OP_STATS;
}

int ts__reply_parse(ts__req *r, uint8_t *body, size_t len)
{
    int rc;
    switch (r->op) {
    case TS_OP_GET:
    case TS_OP_PEEK:
        rc = parse_items(body, len, &r->res.items);
        if (rc == 0) {
            r->res.version = r->res.items->version;
            r->res.n_items = r->res.items->remaining;
        }
        return rc;
    case TS_OP_STATS:
        return parse_stats(body, len, &r->res.value);
    default:
        rc = ts__reply_parse_view(r, body, len);
        ts__body_free(body, len);
        return rc;
    }
}

int ts__reply_parse_view(ts__req *r, const uint8_t *body, size_t len)
{
    assert(!ts__reply_keeps_body(r->op));
    int rc = 0;
    switch (r->op) {
    case TS_OP_LIST:
        rc = parse_list(body, len, &r->res.bins);
        break;
    case TS_OP_PUT:
    case TS_OP_APPEND:
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_WAIT:
        rc = ts__parse_bin_state(body, len, &r->res);
        r->have_state = rc == 0;
        break;
    case TS_OP_HELLO: {
        ts__rd rd;
        uint8_t version = 0, flags = 0;
        uint16_t z16;
        uint32_t z32;
        uint64_t max_body = 0, server_id;
        ts__rd_init(&rd, body, len);
        if (ts__rd_u8(&rd, &version) != 0 || ts__rd_u8(&rd, &flags) != 0 ||
            ts__rd_u16(&rd, &z16) != 0 || ts__rd_u32(&rd, &z32) != 0 ||
            ts__rd_u64(&rd, &max_body) != 0 || ts__rd_u64(&rd, &server_id) != 0 || rd.left != 0 ||
            version != TS_PROTO_VERSION) {
            rc = TS_EPROTO;
            break;
        }
        r->hello_flags = flags;
        r->hello_max_body = max_body;
        break;
    }
    case TS_OP_PING:
    case TS_OP_UNLISTEN:
    case TS_OP_SAVE:
        rc = len == 0 ? 0 : TS_EPROTO; /* their bodies are empty */
        break;
    default: /* no request of ours has another opcode */
        rc = TS_EPROTO;
        break;
    }
    return rc;
}

uint64_t ts__reply_max_body(uint8_t op, uint16_t status, uint64_t large)
{
    uint64_t max;
    if (status != TS_ST_OK) {
        /* An error body is a message; WAIT's TIMEOUT carries the bin state instead. */
        max = op == TS_OP_WAIT && status == TS_ST_TIMEOUT ? TS_BIN_STATE_SIZE : TS_MAX_ERRMSG;
        return max;
    }
    switch (op) {
    case TS_OP_HELLO:
        return TS__HELLO_REPLY_SIZE;
    case TS_OP_PUT:
    case TS_OP_APPEND:
    case TS_OP_DELETE:
    case TS_OP_LISTEN:
    case TS_OP_WAIT:
        return TS_BIN_STATE_SIZE;
    case TS_OP_GET:
    case TS_OP_PEEK:
    case TS_OP_LIST:
        return large;
    case TS_OP_STATS:
        return large < TS__MAX_STATS_REPLY ? large : TS__MAX_STATS_REPLY;
    case TS_OP_NOTIFY:
        return TS__MAX_NOTIFY_BODY;
    default: /* PING, UNLISTEN, SAVE; and opcodes no reply of ours carries */
        return 0;
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
