/*
 * Tensor bins and row access (docs/PROTOCOL.md 8.19 to 8.22).
 *
 * A tensor bin holds exactly one item for its whole life: a record whose root is one tensor,
 * created zero-filled by TENSOR_BIN and then changed only in place, a range of rows at a time,
 * by WRITE_ROWS. Its item is marked live (tsd_item_own.live), which is what makes the bin a
 * tensor bin: PUT, APPEND, GET (and their by-descriptor forms) refuse such a bin, and GET_REF and
 * PEEK_REF hand its descriptor out flagged LIVE, so that same-host readers see the rows as they
 * are written. The item is in a memfd when shared memory is on (shm.c), else on the heap.
 *
 * READ_ROWS and GATHER_ROWS read rows of a tensor in any bin's item (a tensor bin's, or the root
 * or a root map's entry of a plain item). Their reply is an ITEMS body with one record whose root
 * is a tensor of the rows, copied on the loop thread when the request is handled: the reply is
 * the rows as they were at that moment, however many WRITE_ROWS follow while it is being sent.
 *
 * Everything here runs on the loop thread. A row copy is a memcpy on the loop: its cost grows
 * with the rows asked for, bounded by the tensor (READ_ROWS) or by TSD_MAX_GATHER_ROWS rows
 * (GATHER_ROWS), and by --max-memory, which every reply's copy counts against while it is queued.
 */
#include "server.h"

#include "record.h"

/* Room for a printable bin name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define ROWS_NAME_MSG_CAP (TS_MAX_NAME_LEN * 4 + 1)

/* A tensor found in an item's record: its layout, and its data inside the item. */
typedef struct rows_tensor {
    uint8_t dtype;
    unsigned ndim;
    uint64_t dims[TS_MAX_NDIM];
    uint8_t *data;      /* inside the item's record */
    uint64_t row_bytes; /* bytes of one row (element size times dims[1..]) */
} rows_tensor;

/* Outcomes of looking up a tensor (their replies differ). */
enum { FIND_OK = 0, FIND_NOMEM, FIND_NO_KEY, FIND_NOT_MAP, FIND_NOT_TENSOR, FIND_SCALAR };

int tsd_bin_is_tensor(const tsd_bin *b)
{
    if (b == NULL || b->head == NULL || b->head->slot != TSD_ITEM_OWN)
        return 0;
    return ((const tsd_item_own *)(const void *)b->head)->live != 0;
}

/* The receive buffer of a decoded item borrows the item's bytes: nothing to free. */
static void keep_bytes(void *data, size_t len)
{
    (void)data;
    (void)len;
}

/*
 * Decode the record at rec (len bytes, validated when it was stored or received) into a tree that
 * points into it; NULL on allocation failure. Free with ts__record_tree_free.
 */
static ts_value_t *decode_borrowed(uint8_t *rec, size_t len)
{
    ts__rbuf *rb = ts__rbuf_new(rec, len, keep_bytes);
    if (rb == NULL)
        return NULL;
    ts_value_t *root = ts__record_decode(rb, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb); /* the tree holds its own reference */
    return root;
}

/* Fill out from a tensor value v (of a tree over the item's bytes). FIND_OK or FIND_SCALAR. */
static int tensor_of(const ts_value_t *v, rows_tensor *out)
{
    const ts_tensor_t *t = ts_value_tensor(v);
    if (t->ndim < 1)
        return FIND_SCALAR;
    out->dtype = (uint8_t)t->dtype;
    out->ndim = (unsigned)t->ndim;
    for (unsigned i = 0; i < out->ndim; i++)
        out->dims[i] = (uint64_t)t->shape[i];
    out->data = (uint8_t *)t->data;
    /* The validator checked that the whole tensor's size fits 64 bits, so one row's does too. */
    uint64_t rb = ts_dtype_size(t->dtype);
    for (unsigned i = 1; i < out->ndim; i++)
        rb *= out->dims[i];
    out->row_bytes = rb;
    return FIND_OK;
}

/*
 * Find the tensor of item it: its root when key_len is 0, else the entry key of its root map.
 * FIND_OK and *out, or why not.
 */
static int find_tensor(tsd_item *it, const uint8_t *key, size_t key_len, rows_tensor *out)
{
    ts_value_t *root = decode_borrowed(tsd_item_data(it), tsd_item_len(it));
    if (root == NULL)
        return FIND_NOMEM;
    const ts_value_t *v = root;
    int rc = FIND_OK;
    if (key_len > 0) {
        v = NULL;
        if (ts_value_type(root) != TS_TYPE_MAP) {
            rc = FIND_NOT_MAP;
        } else {
            /* Keys are compared as counted bytes (a key holding a NUL byte never matches). */
            for (size_t i = 0; i < ts_value_len(root) && v == NULL; i++) {
                const char *k = ts_map_key_at(root, i);
                if (strlen(k) == key_len && memcmp(k, key, key_len) == 0)
                    v = ts_map_value_at(root, i);
            }
            if (v == NULL)
                rc = FIND_NO_KEY;
        }
    }
    if (rc == FIND_OK)
        rc = ts_value_type(v) == TS_TYPE_TENSOR ? tensor_of(v, out) : FIND_NOT_TENSOR;
    ts__record_tree_free(root);
    return rc;
}

/* The item at index idx of bin (0 = oldest, -1 = newest), or NULL when there is none. */
static tsd_item *bin_item(const tsd_bin *bin, int64_t idx)
{
    int64_t n = bin->n_items;
    if (idx < 0)
        idx += n;
    if (idx < 0 || idx >= n)
        return NULL;
    tsd_item *it = bin->head;
    for (int64_t i = 0; i < idx; i++)
        it = it->next;
    return it;
}

/*
 * Reply with the error that a failed find_tensor stands for. The key is shown printable (cut to
 * what a bin name may hold).
 */
static void reply_find_error(tsd_conn *c, const ts__hdr *h, int rc, const uint8_t *key,
                             size_t key_len)
{
    char pk[ROWS_NAME_MSG_CAP];
    tsd_name_printable(key, key_len < TS_MAX_NAME_LEN ? key_len : TS_MAX_NAME_LEN, pk, sizeof(pk));
    switch (rc) {
    case FIND_NOMEM:
        c->srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL,
                      "out of memory reading the item's record");
        return;
    case FIND_NO_KEY:
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND, "no key %s in the item", pk);
        return;
    case FIND_NOT_MAP:
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "key %s given, but the item's root is not a map", pk);
        return;
    case FIND_NOT_TENSOR:
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      key_len > 0 ? "the value under key %s is not a tensor"
                                  : "the item's root is not a tensor%s",
                      pk);
        return;
    default:
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "a tensor of 0 dimensions has no rows");
        return;
    }
}

static void reply_no_bin(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl)
{
    char pn[ROWS_NAME_MSG_CAP];
    tsd_name_printable(name, nl, pn, sizeof(pn));
    tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND, "no such bin: %s", pn);
}

static void reply_no_item(tsd_conn *c, const ts__hdr *h, int64_t idx, uint32_t n)
{
    tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                  "no item %lld in a bin of %u items (0 is the oldest, -1 the newest)",
                  (long long)idx, n);
}

/*
 * Answer a READ_ROWS or GATHER_ROWS with k rows of t: an ITEMS body of one record whose root is
 * a tensor of shape [k, dims[1..]]. The rows are copied now into the record: from src, k
 * contiguous rows, when src is not NULL; else row index[i] of t for each i. The copy counts against
 * --max-memory until the reply has been written (as orphaned bytes: tsd_item_unref takes them
 * off when the write lets it go).
 */
static void reply_rows(tsd_conn *c, const ts__hdr *h, const tsd_bin *bin, const rows_tensor *t,
                       const uint8_t *src, const int64_t *index, uint64_t k)
{
    tsd_server *srv = c->srv;
    uint64_t dims[TS_MAX_NDIM];
    memcpy(dims, t->dims, sizeof(dims));
    dims[0] = k;
    uint64_t rec_len, data_len;
    if (ts__rows_rec_size(t->dtype, t->ndim, dims, &rec_len) != 0 ||
        ts__rows_tensor_bytes(t->dtype, t->ndim, dims, &data_len) != 0) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "%llu rows of %llu bytes do not fit in a record", (unsigned long long)k,
                      (unsigned long long)t->row_bytes);
        return;
    }
    if (tsd_store_reserve(&srv->store, rec_len) != 0) {
        srv->stats.oom_rejections++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory): the reply's %llu rows need %llu bytes",
                      (unsigned long long)k, (unsigned long long)rec_len);
        return;
    }
    tsd_store_unreserve(&srv->store, rec_len);
    tsd_item *rec = tsd_item_new((size_t)rec_len);
    if (rec == NULL) {
        srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the %llu-byte reply could not be allocated",
                      (unsigned long long)rec_len);
        return;
    }
    uint8_t *p = tsd_item_data(rec);
    size_t head = ts__rows_rec_head_size(t->ndim);
    ts__rows_rec_head_write(p, t->dtype, t->ndim, dims, data_len);
    size_t rb = (size_t)t->row_bytes;
    if (src != NULL) {
        if (data_len > 0)
            memcpy(p + head, src, (size_t)data_len);
    } else {
        for (uint64_t i = 0; i < k; i++)
            memcpy(p + head + i * rb, t->data + (size_t)index[i] * rb, rb);
    }
    /* From here the copy counts as bytes kept alive by a reply only (see item_release). */
    rec->orphan_of = &srv->store;
    atomic_fetch_or_explicit(&rec->refs, TSD_ITEM_ORPHANED, memory_order_acq_rel);
    srv->store.orphaned_bytes += rec_len;

    if (tsd_out_begin(c, h->opcode, h->request_id) != 0) {
        tsd_item_unref(rec);
        return;
    }
    uint64_t body_len = ts__items_head_size(1) + rec_len + ts__msg_items_pad(rec_len);
    if (tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) != 0) {
        tsd_item_unref(rec);
        return;
    }
    size_t ihead = (size_t)ts__items_head_size(1);
    uint8_t *q = tsd_out_bytes(c, ihead);
    if (q == NULL) {
        tsd_item_unref(rec);
        return;
    }
    size_t hlen;
    (void)ts__msg_items_head_encode(q, ihead, bin->version, 1, bin->n_items, &rec_len, &hlen);
    (void)tsd_out_item(c, rec, 0); /* consumes our reference, also on failure */
}

/* ---------------------------------------------------------------------------------------------
 * TENSOR_BIN
 */

/*
 * A zero-filled item of len bytes for a tensor bin, marked live: in a memfd when shared memory is
 * on, else on the heap. NULL on allocation failure.
 */
static tsd_item *tensor_item_new(tsd_server *srv, size_t len)
{
    tsd_item *it = tsd_shm_item_new_zero(srv, len);
    if (it == NULL) {
        tsd_item_own *own = tsd_item_own_new();
        if (own == NULL)
            return NULL;
        /* Sized as the heap pool sizes its buffers, so the buffer may be recycled after it. */
        size_t alloc_len = len < TSD_POOL_MIN ? len : ts__align_up(len, TSD_POOL_ROUND);
        own->data = ts__malloc_aligned(alloc_len);
        if (own->data == NULL) {
            ts__free(own);
            return NULL;
        }
        memset(own->data, 0, alloc_len);
        own->len = len;
        own->alloc_len = alloc_len;
        it = &own->it;
    }
    ((tsd_item_own *)(void *)it)->live = 1;
    return it;
}

int tsd_rows_tensor_item(tsd_server *srv, size_t len, tsd_item **out)
{
    /*
     * With --data-dir (and a record of at least --data-min bytes) the tensor lives in a file,
     * zero-filled, and comes back as a tensor bin after a restart; its pages count against
     * --max-disk (checked by tsd_datadir_alloc), not --max-memory, as every item in a file. Else
     * it counts against --max-memory. Either way the store takes a reservation of its length
     * when it links the item (tsd_store_add), so one is made here: for a file without a check.
     */
    tsd_item *it = NULL;
    int drc = tsd_datadir_alloc(srv, len, &it);
    if (drc < 0)
        return drc;
    if (drc == 0) {
        srv->store.reserved += len;
        ((tsd_item_own *)(void *)it)->live = 1;
    } else {
        /*
         * What the item takes once stored, not only its record, must fit: the record with the
         * rounding of a large buffer (to TSD_POOL_ROUND, on the heap or in a memfd alike) is
         * reserved before anything is allocated; the rest of its overhead (its header, a small
         * memfd's page) is checked once it exists, before the store counts it.
         */
        if (len > SIZE_MAX - TSD_POOL_ROUND)
            return TSD_TENSOR_ITEM_LIMIT; /* no count of bytes used leaves room for it */
        uint64_t round = len < TSD_POOL_MIN ? 0 : ts__align_up(len, TSD_POOL_ROUND) - len;
        if (tsd_store_reserve(&srv->store, len + round) != 0)
            return TSD_TENSOR_ITEM_LIMIT;
        it = tensor_item_new(srv, len);
        if (it == NULL) {
            tsd_store_unreserve(&srv->store, len + round);
            return TSD_TENSOR_ITEM_NOMEM;
        }
        uint64_t rest = tsd_item_overhead(it) - round;
        tsd_store_unreserve(&srv->store, round);
        if (tsd_store_reserve(&srv->store, rest) != 0) {
            tsd_item_unref(it);
            tsd_store_unreserve(&srv->store, len);
            return TSD_TENSOR_ITEM_LIMIT;
        }
        tsd_store_unreserve(&srv->store, rest);
    }
    *out = it;
    return 0;
}

static void op_tensor_bin(tsd_conn *c, const ts__hdr *h, const ts__msg_tensor_bin_req *m)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (m->ndim < 1 || m->ndim > TSD_TENSOR_BIN_MAX_NDIM) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "a tensor bin has 1 to %d dimensions, not %u",
                      TSD_TENSOR_BIN_MAX_NDIM, m->ndim);
        return;
    }
    if (ts_dtype_size((ts_dtype_t)m->dtype) == 0) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "unknown dtype %u", m->dtype);
        return;
    }
    uint64_t rec_len;
    if (ts__rows_rec_size(m->dtype, m->ndim, m->dims, &rec_len) != 0) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "a tensor of this shape does not fit in a record: a dim is over 2^63 - 1, "
                      "or the record (its %zu-byte head and the tensor's data) would take 2^64 "
                      "bytes or more",
                      ts__rows_rec_head_size(m->ndim));
        return;
    }
    if (tsd_store_find(&srv->store, m->name, m->name_len) != NULL) {
        char pn[ROWS_NAME_MSG_CAP];
        tsd_name_printable(m->name, m->name_len, pn, sizeof(pn));
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "bin %s exists (DELETE it first)", pn);
        return;
    }
    tsd_item *it = NULL;
    int trc = tsd_rows_tensor_item(srv, (size_t)rec_len, &it);
    if (trc < 0) {
        char msg[TS_MAX_ERRMSG];
        tsd_datadir_refusal(srv, trc, (size_t)rec_len, msg, sizeof(msg));
        tsd_reply_msg(c, op, rid, TS_ST_OUT_OF_MEMORY, msg, strlen(msg));
        return;
    }
    if (trc == TSD_TENSOR_ITEM_LIMIT) {
        srv->stats.oom_rejections++;
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory): the tensor bin's %llu-byte record, "
                      "with the rounding of its buffer and its header, does not fit",
                      (unsigned long long)rec_len);
        return;
    }
    if (trc == TSD_TENSOR_ITEM_NOMEM) {
        srv->stats.out_of_memory++;
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "tensord is out of memory: the %llu-byte tensor could not be allocated",
                      (unsigned long long)rec_len);
        return;
    }
    uint64_t data_len = rec_len - ts__rows_rec_head_size(m->ndim);
    ts__rows_rec_head_write(tsd_item_data(it), m->dtype, m->ndim, m->dims, data_len);
    uint64_t version = tsd_server_next_version(srv);
    tsd_bin *bin = tsd_store_add(&srv->store, m->name, m->name_len, it, 1, version);
    if (bin == NULL) {
        tsd_store_unreserve(&srv->store, rec_len);
        tsd_item_unref(it);
        srv->stats.out_of_memory++;
        tsd_reply_err(c, op, rid, TS_ST_INTERNAL, "out of memory adding a bin");
        return;
    }
    (void)tsd_datadir_commit(srv, it, m->name, m->name_len,
                             TSD_DATADIR_TENSOR | TSD_DATADIR_REPLACE);
    tsd_reply_state(c, op, rid, TS_ST_OK, version, bin->n_items);
    tsd_notify_change(srv, m->name, m->name_len, version, bin->n_items, TS_NOTE_PUT);
}

/* ---------------------------------------------------------------------------------------------
 * READ_ROWS
 */

static void op_read_rows(tsd_conn *c, const ts__hdr *h, const ts__msg_read_rows_req *m)
{
    tsd_bin *bin = tsd_store_find(&c->srv->store, m->name, m->name_len);
    if (bin == NULL) {
        reply_no_bin(c, h, m->name, m->name_len);
        return;
    }
    tsd_item *it = bin_item(bin, m->item);
    if (it == NULL) {
        reply_no_item(c, h, m->item, bin->n_items);
        return;
    }
    rows_tensor t;
    int rc = find_tensor(it, m->key, m->key_len, &t);
    if (rc != FIND_OK) {
        reply_find_error(c, h, rc, m->key, m->key_len);
        return;
    }
    if (m->start > m->end || m->end > t.dims[0]) {
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "rows [%llu, %llu) are not within the tensor's %llu rows",
                      (unsigned long long)m->start, (unsigned long long)m->end,
                      (unsigned long long)t.dims[0]);
        return;
    }
    reply_rows(c, h, bin, &t, t.data + (size_t)(m->start * t.row_bytes), NULL, m->end - m->start);
}

void tsd_rows_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    if (h->opcode == TS_OP_TENSOR_BIN)
        op_tensor_bin(c, h, &m->u.tensor_bin);
    else
        op_read_rows(c, h, &m->u.read_rows);
}

/* ---------------------------------------------------------------------------------------------
 * GATHER_ROWS and WRITE_ROWS: a name, then a record received like a PUT's
 */

/* The fields of a GATHER_ROWS or WRITE_ROWS record. */
typedef struct rows_args {
    int have_start;
    int64_t item;  /* GATHER_ROWS: which item (0 = oldest, -1 = newest) */
    int64_t start; /* WRITE_ROWS: the first row written */
    const uint8_t *key;
    size_t key_len;
    const ts_tensor_t *tensor; /* GATHER_ROWS "index", WRITE_ROWS "rows" */
} rows_args;

/*
 * Read the fields of a request record (root: a map) into a. 0, or an error reply has been sent.
 * gather: the GATHER_ROWS keys (item, key, index), else WRITE_ROWS's (start, rows).
 */
static int parse_args(tsd_conn *c, const ts__hdr *h, const ts_value_t *root, int gather,
                      rows_args *a)
{
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    const char *tkey = gather ? "index" : "rows";
    memset(a, 0, sizeof(*a));
    if (ts_value_type(root) != TS_TYPE_MAP) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "the %s record's root must be a map",
                      ts__op_name(op));
        return -1;
    }
    unsigned seen = 0; /* a bit per known key: each may be given once */
    for (size_t i = 0; i < ts_value_len(root); i++) {
        const char *k = ts_map_key_at(root, i);
        const ts_value_t *v = ts_map_value_at(root, i);
        int ok;
        unsigned bit;
        if (gather && strcmp(k, "item") == 0) {
            bit = 1;
            ok = ts_value_int(v, &a->item) == 0;
        } else if (gather && strcmp(k, "key") == 0) {
            const char *s;
            bit = 2;
            ok = ts_value_string(v, &s, &a->key_len) == 0;
            a->key = (const uint8_t *)s;
        } else if (!gather && strcmp(k, "start") == 0) {
            bit = 4;
            ok = ts_value_int(v, &a->start) == 0;
            a->have_start = 1;
        } else if (strcmp(k, tkey) == 0) {
            bit = 8;
            a->tensor = ts_value_tensor(v);
            ok = a->tensor != NULL;
        } else {
            char pk[ROWS_NAME_MSG_CAP];
            size_t kl = strlen(k);
            tsd_name_printable((const uint8_t *)k, kl < TS_MAX_NAME_LEN ? kl : TS_MAX_NAME_LEN, pk,
                               sizeof(pk));
            tsd_reply_err(c, op, rid, TS_ST_INVALID, "unknown key %s in the %s record", pk,
                          ts__op_name(op));
            return -1;
        }
        if (seen & bit) {
            tsd_reply_err(c, op, rid, TS_ST_INVALID, "%s: \"%s\" is given twice", ts__op_name(op),
                          k);
            return -1;
        }
        seen |= bit;
        if (!ok) {
            tsd_reply_err(c, op, rid, TS_ST_INVALID, "%s: \"%s\" has the wrong type",
                          ts__op_name(op), k);
            return -1;
        }
    }
    if (a->tensor == NULL || (!gather && !a->have_start)) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      gather ? "GATHER_ROWS needs \"index\""
                             : "WRITE_ROWS needs \"start\" and \"rows\"");
        return -1;
    }
    return 0;
}

static void gather_rows(tsd_conn *c, const ts__hdr *h, tsd_bin *bin, const rows_args *a)
{
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    const ts_tensor_t *ix = a->tensor;
    if (ix->dtype != TS_INT64 || ix->ndim != 1) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "\"index\" must be a 1-D int64 tensor");
        return;
    }
    uint64_t n = (uint64_t)ix->shape[0];
    if (n > TSD_MAX_GATHER_ROWS) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "%llu indexes (at most %llu per GATHER_ROWS)",
                      (unsigned long long)n, (unsigned long long)TSD_MAX_GATHER_ROWS);
        return;
    }
    tsd_item *it = bin_item(bin, a->item);
    if (it == NULL) {
        reply_no_item(c, h, a->item, bin->n_items);
        return;
    }
    rows_tensor t;
    int rc = find_tensor(it, a->key, a->key_len, &t);
    if (rc != FIND_OK) {
        reply_find_error(c, h, rc, a->key, a->key_len);
        return;
    }
    /*
     * Every index is checked before anything is copied. The tensor's data is 64-byte aligned in
     * the received record (section 10.5), so it can be read as int64 values in place.
     */
    const int64_t *idx = ix->data;
    for (uint64_t i = 0; i < n; i++) {
        if (idx[i] < 0 || (uint64_t)idx[i] >= t.dims[0]) {
            tsd_reply_err(c, op, rid, TS_ST_INVALID,
                          "index %lld (position %llu) is not within the tensor's %llu rows",
                          (long long)idx[i], (unsigned long long)i, (unsigned long long)t.dims[0]);
            return;
        }
    }
    reply_rows(c, h, bin, &t, NULL, idx, n);
}

static void write_rows(tsd_conn *c, const ts__hdr *h, tsd_bin *bin, const uint8_t *name, size_t nl,
                       const rows_args *a)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    if (!tsd_bin_is_tensor(bin)) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "WRITE_ROWS needs a tensor bin (made by TENSOR_BIN)");
        return;
    }
    rows_tensor t;
    int rc = find_tensor(bin->head, NULL, 0, &t);
    if (rc != FIND_OK) {
        reply_find_error(c, h, rc, NULL, 0);
        return;
    }
    const ts_tensor_t *r = a->tensor;
    int same = r->dtype == (ts_dtype_t)t.dtype && r->ndim == (int32_t)t.ndim;
    for (unsigned i = 1; same && i < t.ndim; i++)
        same = (uint64_t)r->shape[i] == t.dims[i];
    if (!same) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "\"rows\" must be %s with %u dimensions and the bin's trailing shape",
                      ts_dtype_name((ts_dtype_t)t.dtype), t.ndim);
        return;
    }
    uint64_t k = (uint64_t)r->shape[0];
    if (a->start < 0 || (uint64_t)a->start > t.dims[0] || k > t.dims[0] - (uint64_t)a->start) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "rows [%lld, %lld + %llu) are not within the tensor's %llu rows",
                      (long long)a->start, (long long)a->start, (unsigned long long)k,
                      (unsigned long long)t.dims[0]);
        return;
    }
    /*
     * Passes (LIST, snapshots) that still need the bin take its state of before the write; the
     * bytes themselves change in place for everyone (documented: a snapshot's copy of a tensor
     * bin may hold rows of writes made while it was being written).
     */
    tsd_store_touch(&srv->store, bin);
    if (k > 0)
        memcpy(t.data + (size_t)((uint64_t)a->start * t.row_bytes), r->data,
               (size_t)(k * t.row_bytes));
    uint64_t version = tsd_server_next_version(srv);
    bin->version = version;
    tsd_reply_state(c, op, rid, TS_ST_OK, version, bin->n_items);
    tsd_notify_change(srv, name, nl, version, bin->n_items, TS_NOTE_ROWS);
}

void tsd_rows_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl, tsd_item *item)
{
    tsd_server *srv = c->srv;
    size_t len = tsd_item_len(item);
    srv->stats.ops[h->opcode]++;
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    ts_value_t *root = bin != NULL ? decode_borrowed(tsd_item_data(item), len) : NULL;
    rows_args a;
    if (bin == NULL) {
        reply_no_bin(c, h, name, nl);
    } else if (root == NULL) {
        srv->stats.out_of_memory++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INTERNAL,
                      "out of memory reading the request's record");
    } else if (parse_args(c, h, root, h->opcode == TS_OP_GATHER_ROWS, &a) == 0) {
        if (h->opcode == TS_OP_GATHER_ROWS)
            gather_rows(c, h, bin, &a);
        else
            write_rows(c, h, bin, name, nl, &a);
    }
    if (root != NULL)
        ts__record_tree_free(root);
    /* The request's record was only read: its reservation and buffer go now. */
    tsd_store_unreserve(&srv->store, len);
    tsd_item_unref(item);
}
