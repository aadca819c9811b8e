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
                      "ADD on bin %s: not a counter (a counter holds one item whose record is an "
                      "int; this bin holds %u items)",
                      pn, bin->n_items);
        return;
    }
    if (__builtin_add_overflow(cur, q->delta, &next)) {
        tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_INVALID,
                      "ADD of %lld to counter %s (%lld) overflows int64", (long long)q->delta, pn,
                      (long long)cur);
        return;
    }
    if (tsd_store_reserve(&srv->store, TSD_COUNTER_REC) != 0) {
        srv->stats.oom_rejections++;
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory) adding to a counter");
        return;
    }
    tsd_item *it = tsd_item_new(TSD_COUNTER_REC);
    if (it == NULL) {
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

void tsd_coord_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    switch (h->opcode) {
    case TS_OP_ADD:
        op_add(c, h, &m->u.coord);
        return;
    default:
        tsd_conn_fail(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "unknown opcode 0x%02x",
                      h->opcode);
        return;
    }
}
