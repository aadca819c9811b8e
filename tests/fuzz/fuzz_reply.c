/*
 * Fuzz target: the client's reply decoder (client/reply.c over src/msg.c's decoders), which
 * turns the body of a successful reply into results: items decoded in place (GET, PEEK, and the
 * entries of STREAM_READ and STREAM_RANGE), bin lists (LIST), stats and STREAM_INFO records, bin
 * and stream states and the HELLO answer. REF_ITEMS bodies (GET_REF, PEEK_REF) travel on the
 * descriptor lane instead (client/shm.c): the parser must refuse them, and the lane's own reading
 * of their inline records is replayed below. The first input byte picks the opcode the
 * reply answers; the rest is the body, handed over in a 64-byte aligned buffer exactly as the I/O
 * thread does. A parse must either fail with TS_EPROTO (or TS_ENOMEM) and leave no results, or
 * succeed with results whose every pointer stays inside what it owns; the walk below touches all of
 * them.
 */
#include "fuzz.h"

#include "internal.h"

/* The opcodes whose replies carry a body worth decoding, and two that carry none. */
static const uint8_t ops[] = {
    TS_OP_GET, TS_OP_PEEK, TS_OP_LIST, TS_OP_STATS, TS_OP_PUT, TS_OP_APPEND, TS_OP_DELETE,
    TS_OP_LISTEN, TS_OP_WAIT, TS_OP_HELLO, TS_OP_PING, TS_OP_UNLISTEN,
    /* Streams, last so that the seeds' selectors keep their meaning. */
    TS_OP_STREAM_CREATE, TS_OP_STREAM_APPEND, TS_OP_STREAM_MARK, TS_OP_STREAM_CREDIT,
    TS_OP_STREAM_JOIN, TS_OP_STREAM_READ, TS_OP_STREAM_ACK, TS_OP_STREAM_LEAVE, TS_OP_STREAM_INFO,
    TS_OP_STREAM_RANGE,
    /* By reference, after the streams for the same reason. */
    TS_OP_GET_REF, TS_OP_PEEK_REF};

static volatile uint8_t sink;

/* Read the first and last byte of p[0..n), so that ASan checks the range. */
static void touch(const void *p, size_t n)
{
    if (n == 0)
        return;
    sink = ((const uint8_t *)p)[0];
    sink = ((const uint8_t *)p)[n - 1];
}

/* Walk a decoded value tree through the public accessors, touching every pointer it holds. */
static void walk(const ts_value_t *v, int depth)
{
    FZ_CHECK(v != NULL && depth <= TS_MAX_DEPTH + 1);
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
        for (size_t i = 0; i < ts_value_len(v); i++) {
            const char *k = ts_map_key_at(v, i);
            FZ_CHECK(k != NULL);
            touch(k, strlen(k) + 1);
            walk(ts_map_value_at(v, i), depth + 1);
        }
        FZ_CHECK(ts_map_key_at(v, ts_value_len(v)) == NULL);
        break;
    case TS_TYPE_LIST:
        for (size_t i = 0; i < ts_value_len(v); i++)
            walk(ts_list_at(v, i), depth + 1);
        FZ_CHECK(ts_list_at(v, ts_value_len(v)) == NULL);
        break;
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        FZ_CHECK(t != NULL && t->ndim >= 0 && t->ndim <= TS_MAX_NDIM);
        FZ_CHECK(ts_dtype_size(t->dtype) > 0);
        size_t n = ts_tensor_nbytes(t);
        touch(t->data, n);
        if (n > 0)
            FZ_CHECK(((uintptr_t)t->data % TS__ALIGN) == 0);
        break;
    }
    case TS_TYPE_INT: {
        int64_t i;
        FZ_CHECK(ts_value_int(v, &i) == 0);
        break;
    }
    case TS_TYPE_FLOAT: {
        double d;
        FZ_CHECK(ts_value_float(v, &d) == 0);
        break;
    }
    case TS_TYPE_STRING: {
        const char *s;
        size_t len;
        FZ_CHECK(ts_value_string(v, &s, &len) == 0);
        touch(s, len + 1);
        FZ_CHECK(s[len] == '\0');
        break;
    }
    case TS_TYPE_BYTES: {
        const void *p;
        size_t len;
        FZ_CHECK(ts_value_bytes(v, &p, &len) == 0);
        touch(p, len);
        break;
    }
    default:
        FZ_CHECK(!"unknown value type");
    }
}

/* Check the results of a successful parse. */
static void check_results(uint8_t op, const ts_result_t *res, size_t len)
{
    switch (op) {
    case TS_OP_GET:
    case TS_OP_PEEK: {
        const ts_items_t *items = res->items;
        FZ_CHECK(items != NULL);
        size_t n = ts_items_count(items);
        /* Every item takes at least its length field and 64 bytes of padded record. */
        FZ_CHECK(n <= len / 8);
        for (size_t i = 0; i < n; i++)
            walk(ts_items_at(items, i), 0);
        FZ_CHECK(ts_items_at(items, n) == NULL);
        FZ_CHECK(res->version == ts_items_version(items));
        FZ_CHECK(res->n_items == ts_items_remaining(items));
        break;
    }
    case TS_OP_STREAM_READ:
    case TS_OP_STREAM_RANGE: {
        /* Entries come as items: a decoded record each, NULL for a marker. */
        const ts_items_t *items = res->items;
        FZ_CHECK(items != NULL);
        size_t n = ts_items_count(items);
        FZ_CHECK(n <= TS_STREAM_MAX_READ);
        for (size_t i = 0; i < n; i++) {
            const ts_value_t *v = ts_items_at(items, i);
            if (v != NULL)
                walk(v, 0);
        }
        FZ_CHECK(ts_items_at(items, n) == NULL);
        break;
    }
    case TS_OP_LIST: {
        const ts_bin_list_t *l = res->bins;
        FZ_CHECK(l != NULL);
        for (size_t i = 0; i < l->count; i++) {
            size_t nl = strlen(l->bins[i].name);
            FZ_CHECK(nl <= TS_MAX_NAME_LEN);
            touch(l->bins[i].name, nl + 1);
            if (i > 0)
                FZ_CHECK(strcmp(l->bins[i - 1].name, l->bins[i].name) <= 0);
        }
        break;
    }
    case TS_OP_STATS:
    case TS_OP_STREAM_INFO: /* a record, as STATS's */
        FZ_CHECK(res->value != NULL);
        walk(res->value, 0);
        break;
    default:
        FZ_CHECK(res->items == NULL && res->bins == NULL && res->value == NULL);
        break;
    }
}

/*
 * A REF_ITEMS body as the descriptor lane reads it (client/shm.c, ref_items): the codec's decoder,
 * then every inline record validated and decoded in place from a 64-byte aligned copy of the body
 * (the checks of ts__fz_check_record_in). Descriptor entries need the frame's descriptors, which
 * an input cannot carry; the decoder has checked their ranges (fuzz_msg walks them).
 */
static void ref_inline(const uint8_t *data, size_t len)
{
    ts__msg_ref_items m;
    if (len == 0 || ts__msg_ref_decode(data, len, &m) != 0)
        return;
    uint8_t *body = ts__malloc_aligned(len);
    if (body == NULL)
        return;
    memcpy(body, data, len);
    ts__rbuf *buf = ts__rbuf_new(body, len, NULL);
    if (buf == NULL) {
        ts__free_aligned(body, len);
        return;
    }
    for (uint32_t i = 0; i < m.n_items; i++) {
        ts__msg_ref_entry e;
        ts__msg_ref_entry_get(&m, i, &e);
        if (e.where != TS_REF_INLINE)
            continue;
        FZ_CHECK(e.offset % TS__ALIGN == 0 && e.offset <= len && e.length <= len - e.offset);
        /*
         * Decoded in place exactly when valid, every pointer inside the record; the lane stops
         * at the first invalid one.
         */
        if (ts__fz_check_record_in(buf, (size_t)e.offset, (size_t)e.length) != 0)
            break;
    }
    ts__rbuf_unref(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    uint8_t op = ops[data[0] % TS__ARRAY_SIZE(ops)];
    size_t len = size - 1;
    uint8_t *body = NULL;
    if (len > 0) {
        body = ts__malloc_aligned(len);
        if (body == NULL)
            return 0;
        memcpy(body, data + 1, len);
    }
    ts__req r;
    memset(&r, 0, sizeof(r));
    r.op = op;
    /* The parser takes the body over in every case; the input stays for the codec's verdict. */
    const uint8_t *body_copy = len > 0 ? data + 1 : NULL;
    int rc = ts__reply_parse(&r, body, len);
    FZ_CHECK(rc == 0 || rc == TS_EPROTO || rc == TS_ENOMEM);
    if (rc == 0)
        check_results(op, &r.res, len);
    else if (op != TS_OP_HELLO && op != TS_OP_PUT && op != TS_OP_APPEND && op != TS_OP_DELETE &&
             op != TS_OP_LISTEN && op != TS_OP_WAIT)
        /* A failed parse leaves no results behind (bin states may be half read: unused). */
        FZ_CHECK(r.res.items == NULL && r.res.bins == NULL && r.res.value == NULL);

    /* The parser decodes through the codec: what it accepts, the codec's decoder accepts. */
    ts__msg m;
    if (rc == 0)
        FZ_CHECK(ts__msg_reply_decode(op, TS_ST_OK, body_copy, len, &m) == 0);
    if (op == TS_OP_GET_REF || op == TS_OP_PEEK_REF) {
        FZ_CHECK(rc == TS_EPROTO);
        ref_inline(data + 1, len);
    }

    /* A bin state parsed on its own (WAIT's TIMEOUT answer) is exactly its 16 bytes. */
    ts__req st;
    memset(&st, 0, sizeof(st));
    if (ts__reply_bin_state(&st, data + 1, len) == 0)
        FZ_CHECK(len == TS_BIN_STATE_SIZE && st.have_state);

    ts_items_free(r.res.items);
    ts_bin_list_free(r.res.bins);
    ts_value_free(r.res.value);
    return 0;
}
