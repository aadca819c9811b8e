/*
 * Writes the seed corpora of the fuzz targets with the real encoders:
 *   fuzz_gen_corpus DIR    (DIR is tests/fuzz/corpus; its subdirectories must exist)
 * Seeds are small, valid inputs that reach every branch of the decoders: one record of each
 * shape, one frame of each opcode in both directions, one body of each kind, and lz4 bodies.
 * Every body is written by the message codec's encoders (src/msg.h), so the seeds follow the
 * layouts of docs/PROTOCOL.md by construction. Rerun it after a change
 * of the wire format and commit the files it writes.
 */
#include <stdio.h>
#include <stdlib.h>

#include "compress.h"
#include "msg.h"
#include "proto.h"
#include "record.h"

static const char *out_dir;

/* A growable byte buffer. */
typedef struct gbuf {
    uint8_t *p;
    size_t n, cap;
} gbuf;

static void put(gbuf *b, const void *p, size_t n)
{
    if (b->n + n > b->cap || b->p == NULL) {
        size_t cap = (b->n + n) * 2 + 16;
        b->p = ts__realloc(b->p, cap);
        if (b->p == NULL)
            exit(2);
        b->cap = cap;
    }
    if (n > 0 && p != NULL)
        memcpy(b->p + b->n, p, n);
    b->n += n;
}

/* Room for n more bytes at the end of b; the caller then adds what it wrote to b->n. */
static uint8_t *room(gbuf *b, size_t n)
{
    put(b, NULL, n);
    b->n -= n;
    return b->p + b->n;
}

/* Account for an encoder's output (or give up on its error: the seeds are all valid). */
static void wrote(gbuf *b, int rc, const size_t *len)
{
    if (rc != 0) {
        fprintf(stderr, "gen_corpus: an encoder failed: %s\n", ts_strerror(rc));
        exit(2);
    }
    b->n += *len;
}

/* The bodies of docs/PROTOCOL.md, each written by the codec's encoder (src/msg.c). */

static void body_hello_req(gbuf *b, uint8_t max_version, uint8_t flags, const char *token)
{
    ts__msg_hello_req m = {max_version, flags, (uint16_t)strlen(token), (const uint8_t *)token};
    size_t len, need = ts__msg_hello_req_size(m.token_len);
    wrote(b, ts__msg_hello_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_hello_rep(gbuf *b, uint8_t flags, uint64_t max_body, uint64_t server_id)
{
    ts__msg_hello_rep m = {TS_PROTO_VERSION, flags, max_body, server_id};
    size_t len;
    wrote(b,
          ts__msg_hello_rep_encode(room(b, TS_MSG_HELLO_REP_SIZE), TS_MSG_HELLO_REP_SIZE, &m, &len),
          &len);
}

static void body_name(gbuf *b, const char *name)
{
    ts__msg_name_req m = {.name = (const uint8_t *)name, .name_len = strlen(name)};
    size_t len, need = ts__msg_name_req_size(m.name_len);
    wrote(b, ts__msg_name_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_get(gbuf *b, const char *name, uint32_t max_items)
{
    ts__msg_name_req m = {
        .name = (const uint8_t *)name, .name_len = strlen(name), .max_items = max_items};
    size_t len, need = ts__msg_get_req_size(m.name_len);
    wrote(b, ts__msg_get_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_wait(gbuf *b, const char *name, uint64_t after, uint32_t timeout_ms)
{
    ts__msg_name_req m = {.name = (const uint8_t *)name,
                          .name_len = strlen(name),
                          .after_version = after,
                          .timeout_ms = timeout_ms};
    size_t len, need = ts__msg_wait_req_size(m.name_len);
    wrote(b, ts__msg_wait_req_encode(room(b, need), need, &m, &len), &len);
}

/* The head of a PUT or APPEND body; the record follows (put_record). */
static void body_put_head(gbuf *b, const char *name)
{
    size_t len, nl = strlen(name), need = ts__msg_put_head_size(nl);
    wrote(b, ts__msg_put_head_encode(room(b, need), need, (const uint8_t *)name, nl, &len), &len);
}

static void body_state(gbuf *b, uint64_t version, uint32_t n_items)
{
    size_t len;
    wrote(b,
          ts__msg_bin_state_encode(room(b, TS_BIN_STATE_SIZE), TS_BIN_STATE_SIZE, version, n_items,
                                   &len),
          &len);
}

/* An ITEMS body holding the records recs[0..n) (each a gbuf holding one record). */
static void body_items(gbuf *b, uint64_t version, uint32_t remaining, const gbuf *recs, uint32_t n)
{
    const uint8_t *p[8];
    uint64_t lens[8];
    uint64_t size;
    if (n > 8)
        exit(2);
    for (uint32_t i = 0; i < n; i++) {
        p[i] = recs[i].p;
        lens[i] = recs[i].n;
    }
    if (ts__msg_items_size(n, lens, &size) != 0)
        exit(2);
    size_t len;
    wrote(b,
          ts__msg_items_encode(room(b, (size_t)size), (size_t)size, version, remaining, n, p, lens,
                               &len),
          &len);
}

static void body_list_head(gbuf *b, uint32_t n)
{
    size_t len;
    wrote(b, ts__msg_list_head_encode(room(b, TS_MSG_LIST_FIXED), TS_MSG_LIST_FIXED, n, &len),
          &len);
}

static void body_list_entry(gbuf *b, const char *name, uint32_t n_items, uint64_t bytes,
                            uint64_t version)
{
    ts__msg_list_entry e = {(const uint8_t *)name, strlen(name), n_items, bytes, version};
    size_t len, need = ts__msg_list_entry_size(e.name_len);
    wrote(b, ts__msg_list_entry_encode(room(b, need), need, &e, &len), &len);
}

static void body_notify(gbuf *b, uint64_t version, uint32_t n_items, uint8_t event, uint8_t flags,
                        const char *name)
{
    ts__msg_notify m = {version, n_items, event, flags, (const uint8_t *)name, strlen(name)};
    size_t len, need = ts__msg_notify_size(m.name_len);
    wrote(b, ts__msg_notify_encode(room(b, need), need, &m, &len), &len);
}

static void body_error(gbuf *b, const char *msg)
{
    size_t len, need = strlen(msg);
    wrote(b, ts__msg_error_encode(room(b, need), need, msg, need, &len), &len);
}

/* Stream bodies (src/msg_stream.c), each written by its encoder. */

static void body_stream_create(gbuf *b, const char *name, uint64_t max_entries, uint64_t max_bytes,
                               uint32_t max_age_ms, uint32_t window, uint32_t lease_ms)
{
    ts__msg_stream_create_req m = {(const uint8_t *)name,
                                   strlen(name),
                                   max_entries,
                                   max_bytes,
                                   max_age_ms,
                                   window,
                                   lease_ms,
                                   0};
    size_t len, need = ts__msg_stream_create_req_size(m.name_len);
    wrote(b, ts__msg_stream_create_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_stream_mark(gbuf *b, const char *name, uint64_t tag)
{
    ts__msg_stream_mark_req m = {(const uint8_t *)name, strlen(name), tag};
    size_t len, need = ts__msg_stream_mark_req_size(m.name_len);
    wrote(b, ts__msg_stream_mark_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_stream_credit(gbuf *b, const char *name, uint32_t timeout_ms)
{
    ts__msg_stream_credit_req m = {(const uint8_t *)name, strlen(name), timeout_ms};
    size_t len, need = ts__msg_stream_credit_req_size(m.name_len);
    wrote(b, ts__msg_stream_credit_req_encode(room(b, need), need, &m, &len), &len);
}

/* A request addressed to a member: op picks the layout (JOIN, READ, ACK, LEAVE). */
static void body_stream_member(gbuf *b, uint8_t op, const ts__msg_stream_member_req *m)
{
    size_t len, need;
    switch (op) {
    case TS_OP_STREAM_JOIN:
        need = ts__msg_stream_join_req_size(m->name_len, m->group_len, m->member_len);
        wrote(b, ts__msg_stream_join_req_encode(room(b, need), need, m, &len), &len);
        break;
    case TS_OP_STREAM_READ:
        need = ts__msg_stream_read_req_size(m->name_len, m->group_len, m->member_len);
        wrote(b, ts__msg_stream_read_req_encode(room(b, need), need, m, &len), &len);
        break;
    case TS_OP_STREAM_ACK:
        need = ts__msg_stream_ack_req_size(m->name_len, m->group_len, m->member_len);
        wrote(b, ts__msg_stream_ack_req_encode(room(b, need), need, m, &len), &len);
        break;
    case TS_OP_STREAM_LEAVE:
        need = ts__msg_stream_leave_req_size(m->name_len, m->group_len, m->member_len);
        wrote(b, ts__msg_stream_leave_req_encode(room(b, need), need, m, &len), &len);
        break;
    default:
        exit(2);
    }
}

/* A member request's addressing, from C strings (member "" for LEAVE's whole group). */
static ts__msg_stream_member_req member_req(const char *name, const char *group, const char *member)
{
    ts__msg_stream_member_req m = {.name = (const uint8_t *)name,
                                   .name_len = strlen(name),
                                   .group = (const uint8_t *)group,
                                   .group_len = strlen(group),
                                   .member = member[0] != '\0' ? (const uint8_t *)member : NULL,
                                   .member_len = strlen(member)};
    return m;
}

static void body_stream_range(gbuf *b, const char *name, uint64_t after_id, uint32_t max_entries,
                              uint32_t timeout_ms)
{
    ts__msg_stream_range_req m = {(const uint8_t *)name, strlen(name), after_id, max_entries,
                                  timeout_ms};
    size_t len, need = ts__msg_stream_range_req_size(m.name_len);
    wrote(b, ts__msg_stream_range_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_stream_state(gbuf *b, const ts__msg_stream_state *m)
{
    size_t len, need = TS_MSG_STREAM_STATE_SIZE;
    wrote(b, ts__msg_stream_state_encode(room(b, need), need, m, &len), &len);
}

static void body_stream_append_state(gbuf *b, const ts__msg_stream_append_state *m)
{
    size_t len, need = TS_MSG_STREAM_APPEND_SIZE;
    wrote(b, ts__msg_stream_append_state_encode(room(b, need), need, m, &len), &len);
}

static void body_stream_join_state(gbuf *b, const ts__msg_stream_join_state *m)
{
    size_t len, need = TS_MSG_STREAM_JOIN_SIZE;
    wrote(b, ts__msg_stream_join_state_encode(room(b, need), need, m, &len), &len);
}

static void body_stream_ack_state(gbuf *b, const ts__msg_stream_ack_state *m)
{
    size_t len, need = TS_MSG_STREAM_ACK_SIZE;
    wrote(b, ts__msg_stream_ack_state_encode(room(b, need), need, m, &len), &len);
}

/* An ENTRIES body of the n entries e (records from e[i].record). */
static void body_stream_entries(gbuf *b, uint64_t first_id, uint64_t last_id, uint64_t lost,
                                uint32_t n, const ts__msg_stream_entry *e)
{
    uint64_t size;
    if (ts__msg_stream_entries_size(n, e, &size) != 0)
        exit(2);
    size_t len;
    wrote(b,
          ts__msg_stream_entries_encode(room(b, (size_t)size), (size_t)size, first_id, last_id,
                                        lost, n, e, &len),
          &len);
}

/* By-reference and row bodies (src/msg_ref.c, src/msg_rows.c). */

/* A REF_ITEMS body: recs[i] holds the record of each inline entry i (the encoder sets offsets). */
static void body_ref(gbuf *b, uint64_t version, uint32_t remaining, uint32_t n,
                     ts__msg_ref_entry *e, const uint8_t *const *recs)
{
    uint64_t size;
    if (ts__msg_ref_size(n, e, &size) != 0)
        exit(2);
    size_t len;
    wrote(b,
          ts__msg_ref_encode(room(b, (size_t)size), (size_t)size, version, remaining, n, e, recs,
                             &len),
          &len);
}

static void body_put_fd(gbuf *b, const char *name, uint64_t rec_len)
{
    ts__msg_put_fd_req m = {(const uint8_t *)name, strlen(name), rec_len};
    size_t len, need = ts__msg_put_fd_req_size(m.name_len);
    wrote(b, ts__msg_put_fd_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_tensor_bin(gbuf *b, const char *name, uint8_t dtype, uint8_t ndim,
                            const uint64_t *dims)
{
    ts__msg_tensor_bin_req m = {(const uint8_t *)name, strlen(name), dtype, ndim, {0}};
    if (ndim > TS_MAX_NDIM)
        exit(2);
    for (unsigned i = 0; i < ndim; i++)
        m.dims[i] = dims[i];
    size_t len, need = ts__msg_tensor_bin_req_size(m.name_len, ndim);
    wrote(b, ts__msg_tensor_bin_req_encode(room(b, need), need, &m, &len), &len);
}

static void body_read_rows(gbuf *b, const char *name, int32_t item, const char *key, uint64_t start,
                           uint64_t end)
{
    size_t key_len = strlen(key);
    ts__msg_read_rows_req m = {(const uint8_t *)name,
                               strlen(name),
                               item,
                               key_len > 0 ? (const uint8_t *)key : NULL,
                               key_len,
                               start,
                               end};
    size_t len, need = ts__msg_read_rows_req_size(m.name_len, key_len);
    wrote(b, ts__msg_read_rows_req_encode(room(b, need), need, &m, &len), &len);
}

/* Names, groups and members of the longest length the wire allows (u8), and the longest key. */
static char long_name[TS_MAX_NAME_LEN + 1];
static char long_id[TS_STREAM_MAX_ID_LEN + 1];
static char long_key[TS_MSG_MAX_ROWS_KEY + 1];

static void fill_long(void)
{
    memset(long_name, 'n', TS_MAX_NAME_LEN);
    memset(long_id, 'm', TS_STREAM_MAX_ID_LEN);
    memset(long_key, 'k', TS_MSG_MAX_ROWS_KEY);
}

static void put_zeros(gbuf *b, size_t n)
{
    memset(room(b, n), 0, n);
    b->n += n;
}

static void write_seed(const char *target, const char *name, const void *p, size_t n)
{
    char path[4096];
    int w = snprintf(path, sizeof(path), "%s/%s/%s", out_dir, target, name);
    if (w <= 0 || (size_t)w >= sizeof(path))
        exit(2);
    FILE *f = fopen(path, "wb");
    if (f == NULL || (n > 0 && fwrite(p, 1, n, f) != n) || fclose(f) != 0) {
        fprintf(stderr, "gen_corpus: cannot write %s\n", path);
        exit(2);
    }
}

/* Encode a record into b (and free the tree). */
static void put_record(gbuf *b, ts_value_t *v)
{
    uint8_t *rec;
    size_t len;
    if (v == NULL || ts__record_encode(v, &rec, &len) != 0)
        exit(2);
    put(b, rec, len);
    ts__free_aligned(rec, len);
    ts_value_free(v);
}

/* The records of the corpus, by name. */
static ts_value_t *make_record(int which, const char **name)
{
    static float w[6] = {0.5f, -1.0f, 2.0f, 0.0f, 1e-3f, 42.0f};
    static int64_t big[40];
    int64_t s23[2] = {2, 3};
    int64_t s0[1] = {0};
    int64_t s8[8] = {1, 2, 1, 1, 1, 1, 1, 3};
    ts_value_t *v;
    switch (which) {
    case 0:
        *name = "params_map";
        v = ts_map_new();
        ts_map_set(v, "w", ts_tensor_new(TS_FLOAT32, 2, s23, w, TS_BORROW));
        ts_map_set(v, "step", ts_int_new(7));
        return v;
    case 1: {
        *name = "every_type";
        v = ts_map_new();
        ts_value_t *l = ts_list_new();
        ts_list_push(l, ts_int_new(-3));
        ts_list_push(l, ts_float_new(0.25));
        ts_list_push(l, ts_string_new("hello", 5));
        ts_list_push(l, ts_bytes_new("\x01\x02\x03", 3, TS_BORROW));
        ts_list_push(l, ts_map_new());
        ts_list_push(l, ts_list_new());
        ts_map_set(v, "misc", l);
        ts_map_set(v, "t", ts_tensor_new(TS_INT64, 1, (int64_t[]){40}, big, TS_BORROW));
        ts_map_set(v, "scalar", ts_tensor_new(TS_FLOAT64, 0, NULL, &(double){1.5}, TS_COPY));
        return v;
    }
    case 2:
        *name = "empty_tensors";
        v = ts_list_new();
        ts_list_push(v, ts_tensor_new(TS_FLOAT16, 1, s0, NULL, TS_BORROW));
        ts_list_push(v, ts_tensor_new(TS_COMPLEX128, 3, (int64_t[]){4, 0, 2}, NULL, 0));
        ts_list_push(v, ts_tensor_new(TS_BOOL, 8, s8, "\x01\x00\x01\x01\x00\x01", TS_BORROW));
        return v;
    case 3: {
        *name = "deep_32";
        v = ts_list_new();
        ts_value_t *cur = v;
        for (int i = 0; i < TS_MAX_DEPTH - 2; i++) {
            ts_value_t *l = ts_list_new();
            ts_list_push(cur, l);
            cur = l;
        }
        ts_list_push(cur, ts_int_new(1));
        return v;
    }
    case 4:
        *name = "int_root";
        return ts_int_new(INT64_MIN);
    case 5:
        *name = "string_root";
        return ts_string_new("a\0b", 3);
    case 6: {
        *name = "every_dtype";
        v = ts_map_new();
        for (int dt = TS_BOOL; dt <= TS_COMPLEX128; dt++) {
            char key[8] = {'d', (char)('a' + dt), 0};
            ts_map_set(v, key, ts_tensor_alloc((ts_dtype_t)dt, 1, (int64_t[]){3}));
        }
        return v;
    }
    case 7:
        *name = "bytes_list";
        v = ts_list_new();
        ts_list_push(v, ts_bytes_new(NULL, 0, 0));
        ts_list_push(v, ts_bytes_new(w, 1, TS_COPY));
        ts_list_push(v, ts_bytes_new(big, 65, TS_COPY));
        return v;
    default:
        return NULL;
    }
}

static void records(void)
{
    for (int i = 0;; i++) {
        const char *name;
        ts_value_t *v = make_record(i, &name);
        if (v == NULL)
            break;
        gbuf b = {0};
        put_record(&b, v);
        write_seed("fuzz_record", name, b.p, b.n);
        ts__free(b.p);
    }
}

/* Append a frame: header from the arguments, then the body. */
static void frame(gbuf *out, uint8_t magic, uint8_t op, uint8_t flags, uint16_t status,
                  uint32_t rid, const gbuf *body)
{
    ts__hdr h = {.magic = magic,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = flags,
                 .status = status,
                 .request_id = rid,
                 .body_len = body->n};
    uint8_t hdr[TS_HDR_SIZE];
    ts__hdr_encode(&h, hdr);
    put(out, hdr, sizeof(hdr));
    put(out, body->p, body->n);
}

/* Write one frame as a seed. */
static void seed_frame(const char *name, uint8_t magic, uint8_t op, uint8_t flags, uint16_t status,
                       gbuf *body)
{
    gbuf f = {0};
    frame(&f, magic, op, flags, status, 1, body);
    write_seed("fuzz_frame", name, f.p, f.n);
    ts__free(f.p);
    ts__free(body->p);
    *body = (gbuf){0};
}

static void frames(void)
{
    const uint8_t Q = TS_MAGIC_REQ, P = TS_MAGIC_REP;
    const uint64_t ver = 1764115200000001ull; /* versions start at the realtime clock in us */
    gbuf b = {0};

    body_hello_req(&b, 1, TS_HELLO_LZ4, "token");
    seed_frame("hello_req", Q, TS_OP_HELLO, 0, 0, &b);
    body_hello_rep(&b, TS_HELLO_LZ4, TS_DEFAULT_MAX_FRAME, 0x5eed5eed12345678ull);
    seed_frame("hello_rep", P, TS_OP_HELLO, 0, 0, &b);

    seed_frame("ping_req", Q, TS_OP_PING, 0, 0, &b);
    seed_frame("ping_rep", P, TS_OP_PING, 0, 0, &b);
    seed_frame("stats_req", Q, TS_OP_STATS, 0, 0, &b);
    seed_frame("save_req", Q, TS_OP_SAVE, 0, 0, &b);
    seed_frame("list_req", Q, TS_OP_LIST, 0, 0, &b);

    const char *name;
    body_put_head(&b, "params");
    put_record(&b, make_record(0, &name));
    seed_frame("put_req", Q, TS_OP_PUT, 0, 0, &b);
    body_put_head(&b, "misc");
    put_record(&b, make_record(1, &name));
    seed_frame("append_req", Q, TS_OP_APPEND, 0, 0, &b);

    /* A compressed PUT: zeros compress well. */
    gbuf raw = {0};
    body_put_head(&raw, "zeros");
    put_record(&raw, ts_tensor_alloc(TS_FLOAT32, 1, (int64_t[]){256}));
    size_t cap = ts__lz4_bound(raw.n), blen;
    b.p = ts__malloc(cap);
    if (b.p == NULL || ts__lz4_compress(raw.p, raw.n, b.p, cap, &blen) != 0)
        exit(2);
    b.n = blen;
    b.cap = cap;
    seed_frame("put_req_lz4", Q, TS_OP_PUT, TS_FLAG_LZ4, 0, &b);
    ts__free(raw.p);

    body_state(&b, ver, 1);
    seed_frame("put_rep", P, TS_OP_PUT, 0, 0, &b);

    body_get(&b, "params", 0);
    seed_frame("get_req", Q, TS_OP_GET, 0, 0, &b);
    body_get(&b, "params", 1);
    seed_frame("peek_req", Q, TS_OP_PEEK, 0, 0, &b);

    /* An ITEMS reply with two records. */
    gbuf recs[2] = {{0}};
    put_record(&recs[0], make_record(0, &name));
    put_record(&recs[1], make_record(4, &name));
    body_items(&b, ver + 5, 3, recs, 2);
    seed_frame("peek_rep_items", P, TS_OP_PEEK, 0, 0, &b);
    ts__free(recs[0].p);
    ts__free(recs[1].p);
    body_items(&b, ver + 6, 0, NULL, 0);
    seed_frame("get_rep_empty", P, TS_OP_GET, 0, 0, &b);

    body_error(&b, "no such bin");
    seed_frame("get_rep_not_found", P, TS_OP_GET, 0, TS_ST_NOT_FOUND, &b);

    body_name(&b, "params");
    seed_frame("delete_req", Q, TS_OP_DELETE, 0, 0, &b);
    body_name(&b, "params");
    seed_frame("listen_req", Q, TS_OP_LISTEN, 0, 0, &b);
    body_name(&b, "params");
    seed_frame("unlisten_req", Q, TS_OP_UNLISTEN, 0, 0, &b);
    body_state(&b, ver, 1);
    seed_frame("listen_rep", P, TS_OP_LISTEN, 0, 0, &b);

    body_list_head(&b, 2);
    body_list_entry(&b, "params", 1, 136, ver);
    body_list_entry(&b, "", 3, 192, ver + 2);
    seed_frame("list_rep", P, TS_OP_LIST, 0, 0, &b);

    body_wait(&b, "params", ver, 1000);
    seed_frame("wait_req", Q, TS_OP_WAIT, 0, 0, &b);
    body_state(&b, ver, 1);
    seed_frame("wait_rep_timeout", P, TS_OP_WAIT, 0, TS_ST_TIMEOUT, &b);

    body_notify(&b, ver + 3, 2, TS_NOTE_APPEND, TS_NOTE_FLAG_COALESCED, "params");
    seed_frame("notify", P, TS_OP_NOTIFY, 0, 0, &b);

    ts_value_t *stats = ts_map_new();
    ts_map_set(stats, "uptime_s", ts_int_new(42));
    ts_map_set(stats, "bins", ts_int_new(1));
    put_record(&b, stats);
    seed_frame("stats_rep", P, TS_OP_STATS, 0, 0, &b);

    /* A pipelined stream: HELLO, PUT, GET and PING back to back. */
    gbuf s = {0};
    body_hello_req(&b, 1, 0, "");
    frame(&s, Q, TS_OP_HELLO, 0, 0, 1, &b);
    b.n = 0;
    body_put_head(&b, "p");
    put_record(&b, make_record(2, &name));
    frame(&s, Q, TS_OP_PUT, 0, 0, 2, &b);
    b.n = 0;
    body_get(&b, "p", 0);
    frame(&s, Q, TS_OP_GET, 0, 0, 3, &b);
    b.n = 0;
    frame(&s, Q, TS_OP_PING, 0, 0, 4, &b);
    write_seed("fuzz_frame", "pipeline", s.p, s.n);
    ts__free(s.p);
    ts__free(b.p);
}

static void lz4_bodies(void)
{
    /* Compressed bodies of compressible inputs, and a few raw inputs to compress. */
    const char *name;
    for (int i = 0; i < 3; i++) {
        gbuf raw = {0};
        if (i == 0) {
            put_zeros(&raw, 1000);
        } else {
            put_record(&raw, make_record(i == 1 ? 0 : 6, &name));
            put_zeros(&raw, 256);
        }
        size_t cap = ts__lz4_bound(raw.n), blen;
        uint8_t *body = ts__malloc(cap);
        if (body == NULL || ts__lz4_compress(raw.p, raw.n, body, cap, &blen) != 0)
            exit(2);
        char n[32];
        snprintf(n, sizeof(n), "body_%d", i);
        write_seed("fuzz_lz4", n, body, blen);
        snprintf(n, sizeof(n), "raw_%d", i);
        write_seed("fuzz_lz4", n, raw.p, raw.n);
        ts__free(body);
        ts__free(raw.p);
    }
    uint8_t empty[TS_LZ4_PREFIX + 1] = {0};
    write_seed("fuzz_lz4", "body_empty", empty, sizeof(empty));
}

/*
 * An ENTRIES body with a record, a marker and a redelivered record with rows done (first id 41);
 * the records are two of make_record's.
 */
static void entries_mixed(gbuf *b, uint64_t lost)
{
    const char *unused;
    gbuf r0 = {0}, r1 = {0};
    put_record(&r0, make_record(0, &unused));
    put_record(&r1, make_record(7, &unused));
    ts__msg_stream_entry e[3] = {
        {.id = 41, .len = r0.n, .deliveries = 1, .kind = TS_STREAM_ENTRY_RECORD, .record = r0.p},
        {.id = 42, .tag = 0xe90cull, .deliveries = 1, .kind = TS_STREAM_ENTRY_MARKER},
        {.id = 43,
         .len = r1.n,
         .rows_done = 2,
         .deliveries = 3,
         .kind = TS_STREAM_ENTRY_RECORD,
         .flags = TS_STREAM_ENTRY_REDELIVERED,
         .record = r1.p}};
    body_stream_entries(b, 41, 43, lost, 3, e);
    ts__free(r0.p);
    ts__free(r1.p);
}

/* An ENTRIES body of a lone marker (an epoch boundary) and nothing else. */
static void entries_marker(gbuf *b)
{
    ts__msg_stream_entry e = {
        .id = 7, .tag = UINT64_MAX, .deliveries = 1, .kind = TS_STREAM_ENTRY_MARKER};
    body_stream_entries(b, 7, 7, 0, 1, &e);
}

/*
 * A REF_ITEMS body: an inline record, a live descriptor entry (a tensor bin's item in a file), a
 * second inline record, and a descriptor entry at a nonzero aligned offset filling its file.
 */
static void ref_mixed(gbuf *b, uint64_t version)
{
    const char *unused;
    gbuf r0 = {0}, r1 = {0};
    put_record(&r0, make_record(0, &unused));
    put_record(&r1, make_record(4, &unused));
    ts__msg_ref_entry e[4] = {{.where = TS_REF_INLINE, .length = r0.n},
                              {.where = TS_REF_FD,
                               .flags = TS_REF_LIVE,
                               .offset = 0,
                               .length = 1u << 20,
                               .file_len = 1u << 20},
                              {.where = TS_REF_INLINE, .length = r1.n},
                              {.where = TS_REF_FD,
                               .offset = 2 * TS_REF_FILE_ALIGN,
                               .length = 100,
                               .file_len = 2 * TS_REF_FILE_ALIGN + 100}};
    const uint8_t *recs[4] = {r0.p, NULL, r1.p, NULL};
    body_ref(b, version, 5, 4, e, recs);
    ts__free(r0.p);
    ts__free(r1.p);
}

/* A REF_ITEMS body of descriptor entries only (a body without records). */
static void ref_fds_only(gbuf *b, uint64_t version)
{
    ts__msg_ref_entry e[2] = {
        {.where = TS_REF_FD, .length = 4096, .file_len = 8192},
        {.where = TS_REF_FD, .offset = TS_REF_FILE_ALIGN, .length = 0, .file_len = 4096}};
    body_ref(b, version, 0, 2, e, NULL);
}

/*
 * Reply bodies for fuzz_reply: a selector byte (the index of the opcode in fuzz_reply.c's ops
 * table: GET 0, PEEK 1, LIST 2, STATS 3, PUT 4, DELETE 6, WAIT 8, HELLO 9, PING 10, then the
 * streams STREAM_CREATE 12 to STREAM_RANGE 21 in opcode order, GET_REF 22, PEEK_REF 23), then the
 * body.
 */
enum {
    REPLY_STREAM_CREATE = 12,
    REPLY_STREAM_APPEND,
    REPLY_STREAM_MARK,
    REPLY_STREAM_CREDIT,
    REPLY_STREAM_JOIN,
    REPLY_STREAM_READ,
    REPLY_STREAM_ACK,
    REPLY_STREAM_LEAVE,
    REPLY_STREAM_INFO,
    REPLY_STREAM_RANGE,
    REPLY_GET_REF,
    REPLY_PEEK_REF
};

static void seed_reply(const char *name, uint8_t selector, gbuf *body)
{
    gbuf f = {0};
    put(&f, &selector, 1);
    put(&f, body->p, body->n);
    write_seed("fuzz_reply", name, f.p, f.n);
    ts__free(f.p);
    ts__free(body->p);
    *body = (gbuf){0};
}

static void replies(void)
{
    const uint64_t ver = 1764115200000001ull;
    gbuf b = {0};

    /* ITEMS with three records, each padded to 64 bytes. */
    gbuf recs[3] = {{0}};
    for (int i = 0; i < 3; i++) {
        const char *unused;
        put_record(&recs[i], make_record(i, &unused));
    }
    body_items(&b, ver, 1, recs, 3);
    for (int i = 0; i < 3; i++)
        ts__free(recs[i].p);
    seed_reply("get_items3", 0, &b);

    body_items(&b, ver, 0, NULL, 0);
    seed_reply("peek_empty", 1, &b);

    body_list_head(&b, 3);
    const char *names[3] = {"zeta", "", "alpha"};
    for (int i = 0; i < 3; i++)
        body_list_entry(&b, names[i], (uint32_t)i, 64u * (uint64_t)i, ver + (uint64_t)i);
    seed_reply("list_3", 2, &b);

    ts_value_t *st = ts_map_new();
    ts_map_set(st, "uptime_s", ts_int_new(12));
    ts_map_set(st, "bins", ts_int_new(3));
    put_record(&b, st);
    seed_reply("stats", 3, &b);

    body_state(&b, ver, 1);
    seed_reply("put_state", 4, &b);
    body_state(&b, ver + 5, 0);
    seed_reply("wait_state", 8, &b);

    body_hello_rep(&b, TS_HELLO_LZ4, TS_DEFAULT_MAX_FRAME, 0x5eed5eed12345678ull);
    seed_reply("hello", 9, &b);

    seed_reply("ping", 10, &b);

    /* Streams: each reply body of section 8.23 to 8.32. */
    ts__msg_stream_state ss = {ver, ver + 9, 4096, 10, 2, 1, 54, 64};
    body_stream_state(&b, &ss);
    seed_reply("stream_create", REPLY_STREAM_CREATE, &b);
    ss.credit = UINT32_MAX;
    ss.window = 0;
    body_stream_state(&b, &ss);
    seed_reply("stream_credit_unlimited", REPLY_STREAM_CREDIT, &b);
    ss = (ts__msg_stream_state){0};
    body_stream_state(&b, &ss);
    seed_reply("stream_leave_empty", REPLY_STREAM_LEAVE, &b);
    ts__msg_stream_append_state as = {ver + 10, ver, 53, 11};
    body_stream_append_state(&b, &as);
    seed_reply("stream_append", REPLY_STREAM_APPEND, &b);
    as.id++;
    body_stream_append_state(&b, &as);
    seed_reply("stream_mark", REPLY_STREAM_MARK, &b);
    ts__msg_stream_join_state js = {41, 40, 3, 1, 2, 2};
    body_stream_join_state(&b, &js);
    seed_reply("stream_join", REPLY_STREAM_JOIN, &b);
    entries_mixed(&b, 3);
    seed_reply("stream_read", REPLY_STREAM_READ, &b);
    body_stream_entries(&b, 0, 0, 0, 0, NULL);
    seed_reply("stream_read_empty", REPLY_STREAM_READ, &b);
    ts__msg_stream_ack_state ks = {3, 43, 0, 64};
    body_stream_ack_state(&b, &ks);
    seed_reply("stream_ack", REPLY_STREAM_ACK, &b);
    ts_value_t *info = ts_map_new();
    ts_map_set(info, "max_entries", ts_int_new(1024));
    ts_value_t *groups = ts_list_new();
    ts_value_t *g = ts_map_new();
    ts_map_set(g, "name", ts_string_new("train", 5));
    ts_map_set(g, "next_id", ts_int_new(44));
    ts_list_push(groups, g);
    ts_map_set(info, "groups", groups);
    put_record(&b, info);
    seed_reply("stream_info", REPLY_STREAM_INFO, &b);
    entries_marker(&b);
    seed_reply("stream_range_marker", REPLY_STREAM_RANGE, &b);
    entries_mixed(&b, 0);
    seed_reply("stream_range", REPLY_STREAM_RANGE, &b);

    /* By reference: the lane's bodies (inline records and descriptor entries). */
    ref_mixed(&b, ver);
    seed_reply("get_ref", REPLY_GET_REF, &b);
    ref_fds_only(&b, ver);
    seed_reply("peek_ref_fds", REPLY_PEEK_REF, &b);
    body_ref(&b, ver, 0, 0, NULL, NULL);
    seed_reply("peek_ref_empty", REPLY_PEEK_REF, &b);
}

/*
 * Bodies for fuzz_msg: a selector byte (the index into fuzz_msg.c's pick table, which lists
 * requests HELLO..SAVE as 0..12, then replies, the request mode at 26, the stream requests and
 * replies, then the by-reference and row bodies), then one valid body of that kind.
 */
enum {
    MSG_STREAM_CREATE_REQ = 27,
    MSG_STREAM_APPEND_REQ,
    MSG_STREAM_MARK_REQ,
    MSG_STREAM_CREDIT_REQ,
    MSG_STREAM_JOIN_REQ,
    MSG_STREAM_READ_REQ,
    MSG_STREAM_ACK_REQ,
    MSG_STREAM_LEAVE_REQ,
    MSG_STREAM_INFO_REQ,
    MSG_STREAM_RANGE_REQ,
    MSG_STREAM_CREATE_REP,
    MSG_STREAM_APPEND_REP,
    MSG_STREAM_JOIN_REP,
    MSG_STREAM_READ_REP,
    MSG_STREAM_ACK_REP,
    MSG_STREAM_INFO_REP,
    MSG_STREAM_RANGE_REP,
    MSG_STREAM_BACKPRESSURE,
    MSG_GET_REF_REP,
    MSG_PEEK_REF_REP,
    MSG_PUT_FD_REQ,
    MSG_APPEND_FD_REQ,
    MSG_TENSOR_BIN_REQ,
    MSG_READ_ROWS_REQ
};
static void seed_msg(const char *name, uint8_t selector, gbuf *body)
{
    gbuf f = {0};
    uint8_t sel = selector;
    put(&f, &sel, 1);
    put(&f, body->p, body->n);
    write_seed("fuzz_msg", name, f.p, f.n);
    ts__free(f.p);
    ts__free(body->p);
    *body = (gbuf){0};
}

static void msg_bodies(void)
{
    const uint64_t ver = 1764115200000001ull;
    const char *unused;
    gbuf b = {0};

    body_hello_req(&b, 1, TS_HELLO_LZ4, "secret");
    seed_msg("hello_req", 0, &b);
    seed_msg("ping_req", 1, &b);
    body_put_head(&b, "params");
    put_record(&b, make_record(0, &unused));
    seed_msg("put_req", 2, &b);
    body_put_head(&b, "");
    put_record(&b, make_record(4, &unused));
    seed_msg("append_req", 3, &b);
    body_get(&b, "params", 0);
    seed_msg("get_req", 4, &b);
    body_get(&b, "log", 2);
    seed_msg("peek_req", 5, &b);
    body_name(&b, "log");
    seed_msg("delete_req", 6, &b);
    seed_msg("list_req", 7, &b);
    body_name(&b, "params");
    seed_msg("listen_req", 8, &b);
    body_name(&b, "params");
    seed_msg("unlisten_req", 9, &b);
    body_wait(&b, "params", ver, 5000);
    seed_msg("wait_req", 10, &b);
    seed_msg("stats_req", 11, &b);
    seed_msg("save_req", 12, &b);

    body_hello_rep(&b, TS_HELLO_LZ4, TS_DEFAULT_MAX_FRAME, 0x5eed5eed12345678ull);
    seed_msg("hello_rep", 13, &b);
    seed_msg("ping_rep", 14, &b);
    body_state(&b, ver, 1);
    seed_msg("put_rep", 15, &b);
    gbuf recs[3] = {{0}};
    put_record(&recs[0], make_record(0, &unused));
    put_record(&recs[1], make_record(7, &unused));
    put_record(&recs[2], make_record(4, &unused));
    body_items(&b, ver + 1, 0, recs, 3);
    seed_msg("get_rep", 16, &b);
    body_items(&b, ver, 2, recs + 2, 1);
    seed_msg("peek_rep", 17, &b);
    for (int i = 0; i < 3; i++)
        ts__free(recs[i].p);
    body_list_head(&b, 2);
    body_list_entry(&b, "log", 3, 192, ver + 1);
    body_list_entry(&b, "", 1, 136, ver);
    seed_msg("list_rep", 18, &b);
    seed_msg("unlisten_rep", 19, &b);
    body_state(&b, ver + 4, 1);
    seed_msg("wait_rep", 20, &b);
    body_state(&b, ver, 1);
    seed_msg("wait_rep_timeout", 21, &b);
    ts_value_t *st = ts_map_new();
    ts_map_set(st, "uptime_s", ts_int_new(3600));
    put_record(&b, st);
    seed_msg("stats_rep", 22, &b);
    body_notify(&b, ver + 4, 1, TS_NOTE_PUT, 0, "params");
    seed_msg("notify", 23, &b);
    body_error(&b, "no such bin: params");
    seed_msg("error_rep", 24, &b);
    body_error(&b, "tensord is shutting down");
    seed_msg("conn_error", 25, &b);
}

/* The stream bodies for fuzz_msg: each request and reply, and edges (longest ids, markers). */
static void msg_stream_bodies(void)
{
    const uint64_t ver = 1764115200000001ull;
    const char *unused;
    gbuf b = {0};

    body_stream_create(&b, "frames", 1024, (uint64_t)1 << 30, 60000, 64, 30000);
    seed_msg("stream_create_req", MSG_STREAM_CREATE_REQ, &b);
    body_stream_create(&b, long_name, UINT64_MAX, 0, 0, 0, 0);
    seed_msg("stream_create_req_long_name", MSG_STREAM_CREATE_REQ, &b);
    body_put_head(&b, "frames");
    put_record(&b, make_record(0, &unused));
    seed_msg("stream_append_req", MSG_STREAM_APPEND_REQ, &b);
    body_stream_mark(&b, "frames", 0xe90cull);
    seed_msg("stream_mark_req", MSG_STREAM_MARK_REQ, &b);
    body_stream_credit(&b, "frames", 5000);
    seed_msg("stream_credit_req", MSG_STREAM_CREDIT_REQ, &b);

    ts__msg_stream_member_req m = member_req("frames", "train", "w0");
    m.start = TS_STREAM_START_OLDEST;
    m.lease_ms = 30000;
    body_stream_member(&b, TS_OP_STREAM_JOIN, &m);
    seed_msg("stream_join_req", MSG_STREAM_JOIN_REQ, &b);
    m = member_req(long_name, long_id, long_id);
    m.start = TS_STREAM_START_NEWEST;
    body_stream_member(&b, TS_OP_STREAM_JOIN, &m);
    seed_msg("stream_join_req_long_ids", MSG_STREAM_JOIN_REQ, &b);
    m = member_req("frames", "train", "w0");
    m.ack_through = 40;
    m.max_entries = 16;
    m.timeout_ms = 1000;
    body_stream_member(&b, TS_OP_STREAM_READ, &m);
    seed_msg("stream_read_req", MSG_STREAM_READ_REQ, &b);
    m = member_req("frames", "train", "w0");
    m.first = 41;
    m.last = 43;
    body_stream_member(&b, TS_OP_STREAM_ACK, &m);
    seed_msg("stream_ack_req", MSG_STREAM_ACK_REQ, &b);
    m.first = m.last = 43;
    m.rows = 2;
    body_stream_member(&b, TS_OP_STREAM_ACK, &m);
    seed_msg("stream_ack_req_rows", MSG_STREAM_ACK_REQ, &b);
    m = member_req("frames", "train", "w0");
    body_stream_member(&b, TS_OP_STREAM_LEAVE, &m);
    seed_msg("stream_leave_req", MSG_STREAM_LEAVE_REQ, &b);
    m = member_req("frames", "train", "");
    body_stream_member(&b, TS_OP_STREAM_LEAVE, &m);
    seed_msg("stream_leave_req_group", MSG_STREAM_LEAVE_REQ, &b);
    body_name(&b, "frames");
    seed_msg("stream_info_req", MSG_STREAM_INFO_REQ, &b);
    body_stream_range(&b, "frames", 40, 32, 0);
    seed_msg("stream_range_req", MSG_STREAM_RANGE_REQ, &b);

    ts__msg_stream_state ss = {ver, ver + 9, 4096, 10, 2, 1, 54, 64};
    body_stream_state(&b, &ss);
    seed_msg("stream_create_rep", MSG_STREAM_CREATE_REP, &b);
    ts__msg_stream_append_state as = {ver + 10, ver, 53, 11};
    body_stream_append_state(&b, &as);
    seed_msg("stream_append_rep", MSG_STREAM_APPEND_REP, &b);
    ts__msg_stream_join_state js = {41, 40, 3, 1, 2, 2};
    body_stream_join_state(&b, &js);
    seed_msg("stream_join_rep", MSG_STREAM_JOIN_REP, &b);
    entries_mixed(&b, 3);
    seed_msg("stream_read_rep", MSG_STREAM_READ_REP, &b);
    body_stream_entries(&b, 0, 0, 0, 0, NULL);
    seed_msg("stream_read_rep_empty", MSG_STREAM_READ_REP, &b);
    ts__msg_stream_ack_state ks = {3, 43, 0, 64};
    body_stream_ack_state(&b, &ks);
    seed_msg("stream_ack_rep", MSG_STREAM_ACK_REP, &b);
    ts_value_t *info = ts_map_new();
    ts_map_set(info, "max_entries", ts_int_new(1024));
    put_record(&b, info);
    seed_msg("stream_info_rep", MSG_STREAM_INFO_REP, &b);
    entries_mixed(&b, 0);
    seed_msg("stream_range_rep", MSG_STREAM_RANGE_REP, &b);
    entries_marker(&b);
    seed_msg("stream_range_rep_marker", MSG_STREAM_RANGE_REP, &b);
    body_error(&b, "stream frames: window full");
    seed_msg("stream_backpressure", MSG_STREAM_BACKPRESSURE, &b);
}

/* The by-reference and row bodies for fuzz_msg, with their edges. */
static void msg_ref_bodies(void)
{
    const uint64_t ver = 1764115200000001ull;
    gbuf b = {0};

    ref_mixed(&b, ver);
    seed_msg("get_ref_rep", MSG_GET_REF_REP, &b);
    body_ref(&b, ver, 0, 0, NULL, NULL);
    seed_msg("get_ref_rep_empty", MSG_GET_REF_REP, &b);
    ref_fds_only(&b, ver);
    seed_msg("peek_ref_rep_fds", MSG_PEEK_REF_REP, &b);

    body_put_fd(&b, "params", 4096);
    seed_msg("put_fd_req", MSG_PUT_FD_REQ, &b);
    body_put_fd(&b, long_name, UINT64_MAX);
    seed_msg("put_fd_req_long_name", MSG_PUT_FD_REQ, &b);
    body_put_fd(&b, "", 0);
    seed_msg("append_fd_req", MSG_APPEND_FD_REQ, &b);

    const uint64_t dims[TS_MAX_NDIM] = {1024, 3, 84, 84, 1, 1, 2, (uint64_t)INT64_MAX};
    body_tensor_bin(&b, "replay", TS_FLOAT32, 2, dims);
    seed_msg("tensor_bin_req", MSG_TENSOR_BIN_REQ, &b);
    body_tensor_bin(&b, long_name, TS_UINT8, TS_MAX_NDIM, dims);
    seed_msg("tensor_bin_req_max_ndim", MSG_TENSOR_BIN_REQ, &b);
    /*
     * One dim more than a tensor may have: the decoder takes the body (the server answers
     * INVALID) and the encoder refuses it, so this one is written by hand from a valid one.
     */
    body_tensor_bin(&b, "replay", TS_FLOAT32, TS_MAX_NDIM, dims);
    b.p[1 + strlen("replay") + 1] = TS_MAX_NDIM + 1;
    put_zeros(&b, 8);
    seed_msg("tensor_bin_req_ndim_over", MSG_TENSOR_BIN_REQ, &b);

    body_read_rows(&b, "replay", -1, "obs", 0, 16);
    seed_msg("read_rows_req", MSG_READ_ROWS_REQ, &b);
    body_read_rows(&b, "replay", 0, "", 1000, 1024);
    seed_msg("read_rows_req_root", MSG_READ_ROWS_REQ, &b);
    body_read_rows(&b, long_name, INT32_MIN, long_key, UINT64_MAX, 0);
    seed_msg("read_rows_req_long_key", MSG_READ_ROWS_REQ, &b);
}

/*
 * Inputs for fuzz_msg's request selector (26, the last entry of its pick table): a state byte
 * (bit 0: HELLO done, bit 1: LZ4 granted, bits 2-3: which --max-frame), 24 header bytes, then
 * the body. body_len is the header's (the body given may be shorter, or absent).
 */
#define MSG_REQUEST_SELECTOR 26

static void seed_request(const char *name, uint8_t state, uint8_t op, uint8_t flags,
                         uint64_t body_len, gbuf *body)
{
    gbuf f = {0};
    uint8_t sel[2] = {MSG_REQUEST_SELECTOR, state};
    put(&f, sel, sizeof(sel));
    ts__hdr h = {.magic = TS_MAGIC_REQ,
                 .version = TS_PROTO_VERSION,
                 .opcode = op,
                 .flags = flags,
                 .request_id = 1,
                 .body_len = body_len};
    ts__hdr_encode(&h, room(&f, TS_HDR_SIZE));
    f.n += TS_HDR_SIZE;
    put(&f, body->p, body->n);
    write_seed("fuzz_msg", name, f.p, f.n);
    ts__free(f.p);
    ts__free(body->p);
    *body = (gbuf){0};
}

/* Requests as tensord's header check sees them: admitted ones of each kind, and a few refused. */
static void msg_requests(void)
{
    const uint8_t before_hello = 0, helloed = 1, lz4 = 3, big = 2 << 2;
    const char *unused;
    gbuf b = {0};

    body_hello_req(&b, 1, TS_HELLO_LZ4, "secret");
    seed_request("req_hello", before_hello, TS_OP_HELLO, 0, b.n, &b);
    seed_request("req_ping_before_hello", before_hello, TS_OP_PING, 0, 0, &b);
    body_put_head(&b, "params");
    put_record(&b, make_record(0, &unused));
    seed_request("req_put", helloed | big, TS_OP_PUT, 0, b.n, &b);
    body_put_head(&b, "log");
    seed_request("req_append_head", helloed | big, TS_OP_APPEND, 0, b.n + 4096, &b);
    body_get(&b, "params", 0);
    seed_request("req_get", helloed, TS_OP_GET, 0, b.n, &b);
    body_wait(&b, "params", 1764115200000001ull, 5000);
    seed_request("req_wait", helloed, TS_OP_WAIT, 0, b.n, &b);
    /* A compressed PING of raw length 0: the prefix, then the one block of nothing. */
    put_zeros(&b, TS_LZ4_PREFIX + 1);
    seed_request("req_ping_lz4", lz4, TS_OP_PING, TS_FLAG_LZ4, b.n, &b);
    seed_request("req_lz4_not_granted", helloed, TS_OP_LIST, TS_FLAG_LZ4, 0, &b);
    seed_request("req_ctrl_too_large", helloed | big, TS_OP_STATS, 0, TS_MAX_CTRL_BODY + 1, &b);
    seed_request("req_over_max_frame", helloed, TS_OP_PUT, 0, (uint64_t)1 << 40, &b);
    seed_request("req_notify_opcode", helloed, TS_OP_NOTIFY, 0, 0, &b);

    /* Streams, by reference and rows. */
    body_stream_create(&b, "frames", 1024, 0, 0, 64, 0);
    seed_request("req_stream_create", helloed, TS_OP_STREAM_CREATE, 0, b.n, &b);
    body_put_head(&b, "frames");
    seed_request("req_stream_append_head", helloed | big, TS_OP_STREAM_APPEND, 0, b.n + 256, &b);
    ts__msg_stream_member_req m = member_req("frames", "train", "w0");
    m.max_entries = 16;
    body_stream_member(&b, TS_OP_STREAM_READ, &m);
    seed_request("req_stream_read", helloed, TS_OP_STREAM_READ, 0, b.n, &b);
    body_get(&b, "params", 0);
    seed_request("req_get_ref", helloed, TS_OP_GET_REF, 0, b.n, &b);
    body_put_fd(&b, "params", 4096);
    seed_request("req_put_fd", helloed, TS_OP_PUT_FD, 0, b.n, &b);
    const uint64_t dims[2] = {1024, 3};
    body_tensor_bin(&b, "replay", TS_FLOAT32, 2, dims);
    seed_request("req_tensor_bin", helloed, TS_OP_TENSOR_BIN, 0, b.n, &b);
    body_read_rows(&b, "replay", -1, "", 0, 8);
    seed_request("req_read_rows", helloed, TS_OP_READ_ROWS, 0, b.n, &b);
    body_put_head(&b, "replay");
    seed_request("req_write_rows_head", helloed | big, TS_OP_WRITE_ROWS, 0, b.n + 512, &b);
}

/*
 * fuzz_shard: a selector byte (0 SHARD_MAP reply, 1 WRONG_SHARD body, 2 map file text), then the
 * input: maps not sharded, split and ranged; bodies with and without an owner's address; map
 * files with and without ranges, and one with a hole.
 */
static void shard_seed_map(const char *name, const ts__shard_map *m, uint16_t self)
{
    gbuf b = {0};
    put(&b, "\x00", 1);
    size_t len = 0, size = ts__msg_shard_map_size(m);
    wrote(&b, ts__msg_shard_map_encode(room(&b, size), size, m, self, &len), &len);
    write_seed("fuzz_shard", name, b.p, b.n);
    ts__free(b.p);
}

static void shard_seed_wrong(const char *name, const ts__msg_wrong_shard *w)
{
    gbuf b = {0};
    put(&b, "\x01", 1);
    size_t len = 0;
    wrote(&b, ts__msg_wrong_shard_encode(room(&b, TS_MAX_ERRMSG), TS_MAX_ERRMSG, w, &len), &len);
    write_seed("fuzz_shard", name, b.p, b.n);
    ts__free(b.p);
}

static void shard_seed_file(const char *name, const char *text)
{
    gbuf b = {0};
    put(&b, "\x02", 1);
    put(&b, text, strlen(text));
    write_seed("fuzz_shard", name, b.p, b.n);
    ts__free(b.p);
}

/*
 * The parameter server bodies for fuzz_msg (selectors 67 to 74: fuzz_msg.c's pick table lists
 * PS_CREATE, PS_PUSH, PS_PULL, EMB_CREATE, EMB_PULL and EMB_PUSH requests, then STALE_GRADIENT's
 * bin state and PS_PULL's ITEMS).
 */
static void ps_seeds(void)
{
    enum { SEL_PS_CREATE = 67, SEL_PS_PUSH, SEL_PS_PULL, SEL_EMB_CREATE, SEL_EMB_PULL };
    gbuf b = {0};
    size_t len;
    ts__msg_ps_create_req c = {.name = (const uint8_t *)"w",
                               .name_len = 1,
                               .optimizer = TS_PS_OPT_ADAM,
                               .mode = TS_PS_MODE_SYNC,
                               .sync_k = 8,
                               .tolerance = 2,
                               .lr = 0.001,
                               .beta1 = 0.9,
                               .beta2 = 0.999,
                               .eps = 1e-8};
    wrote(&b, ts__msg_ps_create_req_encode(room(&b, 64), 64, &c, &len), &len);
    seed_msg("ps_create_req", SEL_PS_CREATE, &b);
    c.name = (const uint8_t *)"emb";
    c.name_len = 3;
    c.dim = 16;
    c.init = TS_PSW_INIT_NORMAL;
    c.seed = 7;
    c.num_ids = 1000;
    c.init_scale = 0.1;
    wrote(&b, ts__msg_emb_create_req_encode(room(&b, 80), 80, &c, &len), &len);
    seed_msg("emb_create_req", SEL_EMB_CREATE, &b);
    ts__msg_ps_pull_req q = {.name = (const uint8_t *)"w", .name_len = 1, .if_newer_than = 5};
    wrote(&b, ts__msg_ps_pull_req_encode(room(&b, 16), 16, &q, &len), &len);
    seed_msg("ps_pull_req", SEL_PS_PULL, &b);
    /* PS_PUSH: name, base_version and scale, then a float32 [2] record. */
    uint64_t dims[1] = {2}, rec_len, data_len;
    if (ts__rows_rec_size(TS_FLOAT32, 1, dims, &rec_len) != 0 ||
        ts__rows_tensor_bytes(TS_FLOAT32, 1, dims, &data_len) != 0)
        exit(2);
    uint8_t fixed[TS_MSG_PS_PUSH_FIXED];
    ts__msg_ps_push_fixed f = {.base_version = 3, .scale = 1.0};
    ts__msg_ps_push_fixed_encode(fixed, &f);
    put(&b, "\x01w", 2);
    put(&b, fixed, sizeof(fixed));
    uint8_t *r = room(&b, (size_t)rec_len);
    memset(r, 0, (size_t)rec_len);
    ts__rows_rec_head_write(r, TS_FLOAT32, 1, dims, data_len);
    b.n += (size_t)rec_len;
    seed_msg("ps_push_req", SEL_PS_PUSH, &b);
    /* EMB_PULL: name, then an int64 [2] record of ids. */
    put(&b, "\x03emb", 4);
    r = room(&b, (size_t)rec_len);
    memset(r, 0, (size_t)rec_len);
    ts__rows_rec_head_write(r, TS_INT64, 1, dims, data_len);
    b.n += (size_t)rec_len;
    seed_msg("emb_pull_req", SEL_EMB_PULL, &b);
}

static void shard_seeds(void)
{
    const char *addrs[] = {"h1:8000", "tls://h2:8000", "[::1]:8000"};
    ts__shard_map *m = NULL;
    shard_seed_map("map_unsharded", NULL, 0);
    if (ts__shard_map_default(3, addrs, 7, &m) != 0)
        exit(2);
    shard_seed_map("map_three", m, 1);
    ts__shard_map_free(m);
    if (ts__shard_map_default(4, NULL, 1, &m) != 0)
        exit(2);
    shard_seed_map("map_no_addrs", m, 3);
    ts__shard_map_free(m);
    const char *text = "epoch 9\na:1 0-99,8000-16383 # two ranges\nb:1 100-7999\n";
    if (ts__shard_map_parse(text, strlen(text), &m, NULL, 0) != 0)
        exit(2);
    shard_seed_map("map_ranged", m, 0);
    ts__shard_map_free(m);
    ts__msg_wrong_shard w = {6867, 1, 7, (const uint8_t *)"tls://h2:8000", 13, "not here", 8};
    shard_seed_wrong("wrong_addr", &w);
    ts__msg_wrong_shard u = {1749, 0, 1, NULL, 0, "bin params: slot 1749 is shard 0's", 34};
    shard_seed_wrong("wrong_no_addr", &u);
    shard_seed_file("file_split", "# three shards\nh1:8000\nh2:8000\n[::1]:8000\n");
    shard_seed_file("file_ranged", text);
    shard_seed_file("file_hole", "a:1 0-5\nb:1 7-16383\n");
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    fill_long();
    records();
    frames();
    lz4_bodies();
    replies();
    msg_bodies();
    msg_stream_bodies();
    msg_ref_bodies();
    msg_requests();
    shard_seeds();
    ps_seeds();
    return 0;
}
