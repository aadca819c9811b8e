/*
 * Writes the seed corpora of the fuzz targets with the real encoders:
 *   fuzz_gen_corpus DIR    (DIR is tests/fuzz/corpus; its subdirectories must exist)
 * Seeds are small, valid inputs that reach every branch of the decoders: one record of each
 * shape, one frame of each opcode in both directions, and lz4 bodies. Rerun it after a change
 * of the wire format and commit the files it writes.
 */
#include <stdio.h>
#include <stdlib.h>

#include "compress.h"
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
    if (b->n + n > b->cap) {
        size_t cap = (b->n + n) * 2;
        b->p = ts__realloc(b->p, cap);
        if (b->p == NULL)
            exit(2);
        b->cap = cap;
    }
    if (n > 0)
        memcpy(b->p + b->n, p, n);
    b->n += n;
}

static void put_u8(gbuf *b, uint8_t v)
{
    put(b, &v, 1);
}

static void put_u16(gbuf *b, uint16_t v)
{
    uint8_t x[2];
    ts__put_u16le(x, v);
    put(b, x, 2);
}

static void put_u32(gbuf *b, uint32_t v)
{
    uint8_t x[4];
    ts__put_u32le(x, v);
    put(b, x, 4);
}

static void put_u64(gbuf *b, uint64_t v)
{
    uint8_t x[8];
    ts__put_u64le(x, v);
    put(b, x, 8);
}

static void put_name(gbuf *b, const char *name)
{
    put_u8(b, (uint8_t)strlen(name));
    put(b, name, strlen(name));
}

static void put_zeros(gbuf *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        put_u8(b, 0);
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

    put_u8(&b, 1);
    put_u8(&b, TS_HELLO_LZ4);
    put_u16(&b, 5);
    put(&b, "token", 5);
    seed_frame("hello_req", Q, TS_OP_HELLO, 0, 0, &b);
    put_u8(&b, 1);
    put_u8(&b, TS_HELLO_LZ4);
    put_u16(&b, 0);
    put_u32(&b, 0);
    put_u64(&b, TS_DEFAULT_MAX_FRAME);
    put_u64(&b, 0x5eed5eed12345678ull);
    seed_frame("hello_rep", P, TS_OP_HELLO, 0, 0, &b);

    seed_frame("ping_req", Q, TS_OP_PING, 0, 0, &b);
    seed_frame("ping_rep", P, TS_OP_PING, 0, 0, &b);
    seed_frame("stats_req", Q, TS_OP_STATS, 0, 0, &b);
    seed_frame("save_req", Q, TS_OP_SAVE, 0, 0, &b);
    seed_frame("list_req", Q, TS_OP_LIST, 0, 0, &b);

    const char *name;
    put_name(&b, "params");
    put_record(&b, make_record(0, &name));
    seed_frame("put_req", Q, TS_OP_PUT, 0, 0, &b);
    put_name(&b, "misc");
    put_record(&b, make_record(1, &name));
    seed_frame("append_req", Q, TS_OP_APPEND, 0, 0, &b);

    /* A compressed PUT: zeros compress well. */
    gbuf raw = {0};
    put_name(&raw, "zeros");
    put_record(&raw, ts_tensor_alloc(TS_FLOAT32, 1, (int64_t[]){256}));
    size_t cap = ts__lz4_bound(raw.n), blen;
    b.p = ts__malloc(cap);
    if (b.p == NULL || ts__lz4_compress(raw.p, raw.n, b.p, cap, &blen) != 0)
        exit(2);
    b.n = blen;
    b.cap = cap;
    seed_frame("put_req_lz4", Q, TS_OP_PUT, TS_FLAG_LZ4, 0, &b);
    ts__free(raw.p);

    put_u64(&b, ver);
    put_u32(&b, 1);
    put_u32(&b, 0);
    seed_frame("put_rep", P, TS_OP_PUT, 0, 0, &b);

    put_name(&b, "params");
    put_u32(&b, 0);
    seed_frame("get_req", Q, TS_OP_GET, 0, 0, &b);
    put_name(&b, "params");
    put_u32(&b, 1);
    seed_frame("peek_req", Q, TS_OP_PEEK, 0, 0, &b);

    /* An ITEMS reply with two records. */
    gbuf r0 = {0}, r1 = {0};
    put_record(&r0, make_record(0, &name));
    put_record(&r1, make_record(4, &name));
    put_u64(&b, ver + 5);
    put_u32(&b, 2);
    put_u32(&b, 3);
    put_u64(&b, r0.n);
    put_u64(&b, r1.n);
    put_zeros(&b, (size_t)ts__items_head_size(2) - b.n);
    put(&b, r0.p, r0.n);
    put_zeros(&b, ts__align_up(r0.n, TS__ALIGN) - r0.n);
    put(&b, r1.p, r1.n);
    put_zeros(&b, ts__align_up(r1.n, TS__ALIGN) - r1.n);
    seed_frame("peek_rep_items", P, TS_OP_PEEK, 0, 0, &b);
    ts__free(r0.p);
    ts__free(r1.p);
    put_u64(&b, ver + 6);
    put_u32(&b, 0);
    put_u32(&b, 0);
    put_zeros(&b, 48);
    seed_frame("get_rep_empty", P, TS_OP_GET, 0, 0, &b);

    put(&b, "no such bin", 11);
    seed_frame("get_rep_not_found", P, TS_OP_GET, 0, TS_ST_NOT_FOUND, &b);

    put_name(&b, "params");
    seed_frame("delete_req", Q, TS_OP_DELETE, 0, 0, &b);
    put_name(&b, "params");
    seed_frame("listen_req", Q, TS_OP_LISTEN, 0, 0, &b);
    put_name(&b, "params");
    seed_frame("unlisten_req", Q, TS_OP_UNLISTEN, 0, 0, &b);
    put_u64(&b, ver);
    put_u32(&b, 1);
    put_u32(&b, 0);
    seed_frame("listen_rep", P, TS_OP_LISTEN, 0, 0, &b);

    put_u32(&b, 2);
    put_u32(&b, 0);
    put_name(&b, "params");
    put_u32(&b, 1);
    put_u64(&b, 136);
    put_u64(&b, ver);
    put_name(&b, "");
    put_u32(&b, 3);
    put_u64(&b, 192);
    put_u64(&b, ver + 2);
    seed_frame("list_rep", P, TS_OP_LIST, 0, 0, &b);

    put_name(&b, "params");
    put_u64(&b, ver);
    put_u32(&b, 1000);
    seed_frame("wait_req", Q, TS_OP_WAIT, 0, 0, &b);
    put_u64(&b, ver);
    put_u32(&b, 1);
    put_u32(&b, 0);
    seed_frame("wait_rep_timeout", P, TS_OP_WAIT, 0, TS_ST_TIMEOUT, &b);

    put_u64(&b, ver + 3);
    put_u32(&b, 2);
    put_u8(&b, TS_NOTE_APPEND);
    put_u8(&b, TS_NOTE_FLAG_COALESCED);
    put_name(&b, "params");
    seed_frame("notify", P, TS_OP_NOTIFY, 0, 0, &b);

    ts_value_t *stats = ts_map_new();
    ts_map_set(stats, "uptime_s", ts_int_new(42));
    ts_map_set(stats, "bins", ts_int_new(1));
    put_record(&b, stats);
    seed_frame("stats_rep", P, TS_OP_STATS, 0, 0, &b);

    /* A pipelined stream: HELLO, PUT, GET and PING back to back. */
    gbuf s = {0};
    put_u8(&b, 1);
    put_u8(&b, 0);
    put_u16(&b, 0);
    frame(&s, Q, TS_OP_HELLO, 0, 0, 1, &b);
    b.n = 0;
    put_name(&b, "p");
    put_record(&b, make_record(2, &name));
    frame(&s, Q, TS_OP_PUT, 0, 0, 2, &b);
    b.n = 0;
    put_name(&b, "p");
    put_u32(&b, 0);
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
 * Reply bodies for fuzz_reply: a selector byte (the index of the opcode in fuzz_reply.c's ops
 * table: GET 0, PEEK 1, LIST 2, STATS 3, PUT 4, DELETE 6, WAIT 8, HELLO 9, PING 10), then the body.
 */
static void seed_reply(const char *name, uint8_t selector, gbuf *body)
{
    gbuf f = {0};
    put_u8(&f, selector);
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
    put_u64(&b, ver);
    put_u32(&b, 3);
    put_u32(&b, 1);
    for (int i = 0; i < 3; i++)
        put_u64(&b, recs[i].n);
    put_zeros(&b, (size_t)ts__items_head_size(3) - b.n);
    for (int i = 0; i < 3; i++) {
        put(&b, recs[i].p, recs[i].n);
        put_zeros(&b, ts__align_up(recs[i].n, TS__ALIGN) - recs[i].n);
        ts__free(recs[i].p);
    }
    seed_reply("get_items3", 0, &b);

    put_u64(&b, ver);
    put_zeros(&b, (size_t)ts__items_head_size(0) - 8);
    seed_reply("peek_empty", 1, &b);

    put_u32(&b, 3);
    put_u32(&b, 0);
    const char *names[3] = {"zeta", "", "alpha"};
    for (int i = 0; i < 3; i++) {
        put_name(&b, names[i]);
        put_u32(&b, (uint32_t)i);
        put_u64(&b, 64u * (uint64_t)i);
        put_u64(&b, ver + (uint64_t)i);
    }
    seed_reply("list_3", 2, &b);

    ts_value_t *st = ts_map_new();
    ts_map_set(st, "uptime_s", ts_int_new(12));
    ts_map_set(st, "bins", ts_int_new(3));
    put_record(&b, st);
    seed_reply("stats", 3, &b);

    put_u64(&b, ver);
    put_u32(&b, 1);
    put_u32(&b, 0);
    seed_reply("put_state", 4, &b);
    put_u64(&b, ver + 5);
    put_u32(&b, 0);
    put_u32(&b, 0);
    seed_reply("wait_state", 8, &b);

    put_u8(&b, 1);
    put_u8(&b, TS_HELLO_LZ4);
    put_u16(&b, 0);
    put_u32(&b, 0);
    put_u64(&b, TS_DEFAULT_MAX_FRAME);
    put_u64(&b, 0x5eed5eed12345678ull);
    seed_reply("hello", 9, &b);

    seed_reply("ping", 10, &b);
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
        return 2;
    }
    out_dir = argv[1];
    records();
    frames();
    lz4_bodies();
    replies();
    return 0;
}
