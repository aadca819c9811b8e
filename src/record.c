/* Record codec: plan/encode, validate, decode. See record.h for the layout. */
#include "record.h"

#include <stdalign.h>
#include <stddef.h>

const uint8_t ts__zeros[TS__ALIGN];

/* ----------------------------------------------------------------------------------------------
 * Validation
 */

typedef struct vstate {
    const uint8_t *meta;
    size_t meta_len;
    size_t pos;
    uint64_t data_len;
    uint64_t data_pos; /* end of the last data range seen */
    int max_depth;
    int max_ndim;
    ts__rec_info info;
} vstate;

/* Take n bytes of meta; NULL when fewer are left. */
static const uint8_t *vtake(vstate *s, size_t n)
{
    if (s->meta_len - s->pos < n)
        return NULL;
    const uint8_t *p = s->meta + s->pos;
    s->pos += n;
    return p;
}

/* Check a data range [off, off+len) against the data area and the order rule. 0 or -1. */
static int vrange(vstate *s, uint64_t off, uint64_t len)
{
    uint64_t end;
    if (off % TS__ALIGN != 0 || off < s->data_pos)
        return -1;
    if (__builtin_add_overflow(off, len, &end) || end > s->data_len)
        return -1;
    s->data_pos = end;
    return 0;
}

/* Validate one value at the current position. Returns 0 or -1. */
static int vvalue(vstate *s, int depth)
{
    const uint8_t *p = vtake(s, 1);
    if (p == NULL || depth > s->max_depth)
        return -1;
    s->info.n_nodes++;
    switch (p[0]) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int is_map = p[0] == TS_TYPE_MAP;
        const uint8_t *c = vtake(s, 4);
        if (c == NULL)
            return -1;
        uint32_t count = ts__get_u32le(c);
        /* Each entry needs at least 1 byte (3 for a map entry): a cheap bound before looping. */
        if ((uint64_t)count * (is_map ? 3u : 1u) > s->meta_len - s->pos)
            return -1;
        s->info.n_children += count;
        for (uint32_t i = 0; i < count; i++) {
            if (is_map) {
                const uint8_t *k = vtake(s, 2);
                if (k == NULL)
                    return -1;
                uint16_t klen = ts__get_u16le(k);
                if (vtake(s, klen) == NULL)
                    return -1;
                s->info.str_bytes += (size_t)klen + 1;
            }
            if (vvalue(s, depth + 1) != 0)
                return -1;
        }
        return 0;
    }
    case TS_TYPE_TENSOR: {
        const uint8_t *t = vtake(s, 4);
        if (t == NULL)
            return -1;
        size_t esize = ts_dtype_size((ts_dtype_t)t[0]);
        int ndim = t[1];
        if (esize == 0 || ndim > s->max_ndim || ndim > TS_MAX_NDIM || ts__get_u16le(t + 2) != 0)
            return -1;
        const uint8_t *d = vtake(s, (size_t)ndim * 8 + 16);
        if (d == NULL)
            return -1;
        uint64_t bytes = esize;
        for (int i = 0; i < ndim; i++) {
            uint64_t dim = ts__get_u64le(d + 8 * i);
            if (dim > (uint64_t)INT64_MAX || __builtin_mul_overflow(bytes, dim, &bytes))
                return -1;
        }
        uint64_t off = ts__get_u64le(d + 8 * ndim);
        uint64_t len = ts__get_u64le(d + 8 * ndim + 8);
        if (len != bytes || len > (uint64_t)SIZE_MAX)
            return -1;
        return vrange(s, off, len);
    }
    case TS_TYPE_INT:
    case TS_TYPE_FLOAT:
        return vtake(s, 8) == NULL ? -1 : 0;
    case TS_TYPE_STRING: {
        const uint8_t *l = vtake(s, 4);
        if (l == NULL)
            return -1;
        uint32_t len = ts__get_u32le(l);
        if (vtake(s, len) == NULL)
            return -1;
        s->info.str_bytes += (size_t)len + 1;
        return 0;
    }
    case TS_TYPE_BYTES: {
        const uint8_t *b = vtake(s, 16);
        if (b == NULL)
            return -1;
        return vrange(s, ts__get_u64le(b), ts__get_u64le(b + 8));
    }
    default:
        return -1;
    }
}

int ts__record_validate(const uint8_t *buf, size_t len, int max_depth, int max_ndim,
                        ts__rec_info *info)
{
    if (len < TS_REC_HDR_SIZE || buf[0] != TS_REC_MAGIC0 || buf[1] != TS_REC_MAGIC1 ||
        buf[2] != TS_REC_MAGIC2 || buf[3] != TS_REC_MAGIC3)
        return TS_EBADRECORD;
    uint32_t meta_len = ts__get_u32le(buf + 4);
    uint64_t data_len = ts__get_u64le(buf + 8);
    uint64_t data_start, total;
    if (meta_len > len - TS_REC_HDR_SIZE)
        return TS_EBADRECORD;
    if (ts__align_up_checked((uint64_t)TS_REC_HDR_SIZE + meta_len, TS__ALIGN, &data_start) != 0 ||
        __builtin_add_overflow(data_start, data_len, &total) || total != len)
        return TS_EBADRECORD;
    for (uint64_t i = TS_REC_HDR_SIZE + (uint64_t)meta_len; i < data_start; i++)
        if (buf[i] != 0)
            return TS_EBADRECORD;

    vstate s = {.meta = buf + TS_REC_HDR_SIZE,
                .meta_len = meta_len,
                .data_len = data_len,
                .max_depth = max_depth,
                .max_ndim = max_ndim};
    if (vvalue(&s, 1) != 0 || s.pos != meta_len)
        return TS_EBADRECORD;
    s.info.data_start = data_start;
    if (info != NULL)
        *info = s.info;
    return 0;
}

/* ----------------------------------------------------------------------------------------------
 * Receive buffers
 */

ts__rbuf *ts__rbuf_new(uint8_t *data, size_t len, void (*free_fn)(void *data, size_t len))
{
    ts__rbuf *b = ts__malloc(sizeof(*b));
    if (b == NULL)
        return NULL;
    atomic_init(&b->refs, 1);
    b->data = data;
    b->len = len;
    b->free_fn = free_fn;
    return b;
}

void ts__rbuf_ref(ts__rbuf *b)
{
    atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
}

void ts__rbuf_unref(ts__rbuf *b)
{
    if (b == NULL || atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) != 1)
        return;
    if (b->free_fn != NULL)
        b->free_fn(b->data, b->len);
    else
        ts__free_aligned(b->data, b->len);
    ts__free(b);
}

/* ----------------------------------------------------------------------------------------------
 * Decoding: one allocation holds every node, child pointer, key pointer and string of a tree.
 */

typedef struct dblock {
    ts__rbuf *buf;
    ts_value_t nodes[];
} dblock;

typedef struct dstate {
    ts__rbuf *rbuf;
    const uint8_t *meta;
    size_t pos;
    const uint8_t *data;
    ts_value_t *nodes;
    size_t next_node;
    ts_value_t **ptrs;
    size_t next_ptr;
    char **keys;
    size_t next_key;
    char *strs;
} dstate;

static char *dstr(dstate *s, const uint8_t *p, size_t n)
{
    char *r = s->strs;
    memcpy(r, p, n);
    r[n] = '\0';
    s->strs += n + 1;
    return r;
}

/* Decode one (already validated) value into the next node. */
static ts_value_t *dvalue(dstate *s)
{
    ts_value_t *v = &s->nodes[s->next_node++];
    const uint8_t *m = s->meta;
    v->type = m[s->pos++];
    v->flags = TS__VF_RECEIVED;
    v->rbuf = s->rbuf;
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        uint32_t count = ts__get_u32le(m + s->pos);
        s->pos += 4;
        v->len = count;
        v->u.c.items = s->ptrs + s->next_ptr;
        s->next_ptr += count;
        v->u.c.keys = NULL;
        if (v->type == TS_TYPE_MAP) {
            v->u.c.keys = s->keys + s->next_key;
            s->next_key += count;
        }
        for (uint32_t i = 0; i < count; i++) {
            if (v->type == TS_TYPE_MAP) {
                uint16_t klen = ts__get_u16le(m + s->pos);
                v->u.c.keys[i] = dstr(s, m + s->pos + 2, klen);
                s->pos += 2 + (size_t)klen;
            }
            v->u.c.items[i] = dvalue(s);
        }
        break;
    }
    case TS_TYPE_TENSOR: {
        ts_tensor_t *t = &v->u.tensor;
        t->dtype = (ts_dtype_t)m[s->pos];
        t->ndim = m[s->pos + 1];
        s->pos += 4;
        for (int i = 0; i < t->ndim; i++)
            t->shape[i] = (int64_t)ts__get_u64le(m + s->pos + 8 * (size_t)i);
        s->pos += 8 * (size_t)t->ndim;
        uint64_t off = ts__get_u64le(m + s->pos);
        s->pos += 16;
        t->data = (void *)(s->data + off);
        break;
    }
    case TS_TYPE_INT:
        v->u.i = (int64_t)ts__get_u64le(m + s->pos);
        s->pos += 8;
        break;
    case TS_TYPE_FLOAT: {
        uint64_t bits = ts__get_u64le(m + s->pos);
        memcpy(&v->u.f, &bits, sizeof(bits));
        s->pos += 8;
        break;
    }
    case TS_TYPE_STRING: {
        uint32_t len = ts__get_u32le(m + s->pos);
        v->len = len;
        v->u.str = dstr(s, m + s->pos + 4, len);
        s->pos += 4 + (size_t)len;
        break;
    }
    case TS_TYPE_BYTES:
        v->u.bytes = s->data + ts__get_u64le(m + s->pos);
        v->len = (size_t)ts__get_u64le(m + s->pos + 8);
        s->pos += 16;
        break;
    default:
        break;
    }
    return v;
}

ts_value_t *ts__record_decode(ts__rbuf *buf, size_t off, size_t len, int max_depth, int max_ndim)
{
    if (off > buf->len || len > buf->len - off)
        return NULL;
    const uint8_t *rec = buf->data + off;
    ts__rec_info info;
    if (ts__record_validate(rec, len, max_depth, max_ndim, &info) != 0)
        return NULL;
    /* Layout: header, nodes, child pointers, key pointers (<= children), strings. */
    size_t sz = sizeof(dblock);
    size_t nodes_sz, ptrs_sz;
    if (__builtin_mul_overflow(info.n_nodes, sizeof(ts_value_t), &nodes_sz) ||
        __builtin_mul_overflow(info.n_children, 2 * sizeof(void *), &ptrs_sz) ||
        __builtin_add_overflow(sz, nodes_sz, &sz) || __builtin_add_overflow(sz, ptrs_sz, &sz) ||
        __builtin_add_overflow(sz, info.str_bytes, &sz))
        return NULL;
    dblock *b = ts__malloc(sz);
    if (b == NULL)
        return NULL;
    memset(b->nodes, 0, nodes_sz);
    dstate s = {
        .rbuf = buf,
        .meta = rec + TS_REC_HDR_SIZE,
        .data = rec + info.data_start,
        .nodes = b->nodes,
        .ptrs = (ts_value_t **)((uint8_t *)b->nodes + nodes_sz),
    };
    s.keys = (char **)(s.ptrs + info.n_children);
    s.strs = (char *)(s.keys + info.n_children);
    ts_value_t *root = dvalue(&s);
    root->flags |= TS__VF_ROOT;
    b->buf = buf;
    ts__rbuf_ref(buf);
    return root;
}

void ts__record_tree_free(ts_value_t *root)
{
    if (root == NULL)
        return;
    dblock *b = (dblock *)((uint8_t *)root - offsetof(dblock, nodes));
    ts__rbuf_unref(b->buf);
    ts__free(b);
}

/* ----------------------------------------------------------------------------------------------
 * Encoding
 */

typedef struct pstate {
    size_t meta_len;
    size_t nsegs;
    int too_deep;
} pstate;

/* First pass: meta size and number of data segments. */
static void psize(const ts_value_t *v, int depth, pstate *s)
{
    if (depth > TS_MAX_DEPTH) {
        s->too_deep = 1;
        return;
    }
    s->meta_len += 1;
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        s->meta_len += 4;
        for (size_t i = 0; i < v->len; i++) {
            if (v->type == TS_TYPE_MAP)
                s->meta_len += 2 + strlen(v->u.c.keys[i]);
            psize(v->u.c.items[i], depth + 1, s);
        }
        break;
    case TS_TYPE_TENSOR:
        s->meta_len += 4 + 8 * (size_t)v->u.tensor.ndim + 16;
        s->nsegs++;
        break;
    case TS_TYPE_INT:
    case TS_TYPE_FLOAT:
        s->meta_len += 8;
        break;
    case TS_TYPE_STRING:
        s->meta_len += 4 + v->len;
        break;
    case TS_TYPE_BYTES:
        s->meta_len += 16;
        s->nsegs++;
        break;
    default:
        break;
    }
}

typedef struct wstate {
    uint8_t *m;
    size_t pos;
    ts__seg *segs;
    size_t nsegs;
    uint64_t data_pos;
} wstate;

static void wseg(wstate *s, const void *ptr, size_t len)
{
    uint64_t off = ts__align_up(s->data_pos, TS__ALIGN);
    if (s->nsegs > 0)
        s->segs[s->nsegs - 1].pad_after = off - s->data_pos;
    s->segs[s->nsegs].ptr = ptr;
    s->segs[s->nsegs].len = len;
    s->segs[s->nsegs].pad_after = 0;
    s->nsegs++;
    ts__put_u64le(s->m + s->pos, off);
    ts__put_u64le(s->m + s->pos + 8, len);
    s->pos += 16;
    s->data_pos = off + len;
}

/* Second pass: write meta and collect segments. */
static void pwrite(const ts_value_t *v, wstate *s)
{
    uint8_t *m = s->m;
    m[s->pos++] = v->type;
    switch (v->type) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        ts__put_u32le(m + s->pos, (uint32_t)v->len);
        s->pos += 4;
        for (size_t i = 0; i < v->len; i++) {
            if (v->type == TS_TYPE_MAP) {
                size_t kl = strlen(v->u.c.keys[i]);
                ts__put_u16le(m + s->pos, (uint16_t)kl);
                memcpy(m + s->pos + 2, v->u.c.keys[i], kl);
                s->pos += 2 + kl;
            }
            pwrite(v->u.c.items[i], s);
        }
        break;
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = &v->u.tensor;
        m[s->pos] = (uint8_t)t->dtype;
        m[s->pos + 1] = (uint8_t)t->ndim;
        ts__put_u16le(m + s->pos + 2, 0);
        s->pos += 4;
        for (int i = 0; i < t->ndim; i++) {
            ts__put_u64le(m + s->pos, (uint64_t)t->shape[i]);
            s->pos += 8;
        }
        wseg(s, t->data, ts_tensor_nbytes(t));
        break;
    }
    case TS_TYPE_INT:
        ts__put_u64le(m + s->pos, (uint64_t)v->u.i);
        s->pos += 8;
        break;
    case TS_TYPE_FLOAT: {
        uint64_t bits;
        memcpy(&bits, &v->u.f, sizeof(bits));
        ts__put_u64le(m + s->pos, bits);
        s->pos += 8;
        break;
    }
    case TS_TYPE_STRING:
        ts__put_u32le(m + s->pos, (uint32_t)v->len);
        memcpy(m + s->pos + 4, v->u.str, v->len);
        s->pos += 4 + v->len;
        break;
    case TS_TYPE_BYTES:
        wseg(s, v->u.bytes, v->len);
        break;
    default:
        break;
    }
}

_Static_assert(TS_MAX_DEPTH == 32, "ts__record_plan_why names the depth limit");

const char *ts__record_plan_why(int rc)
{
    if (rc == TS_EINVAL)
        return "nested deeper than 32 levels, or more than 4 GiB of keys, strings and shapes";
    return ts_strerror(rc);
}

int ts__record_plan(const ts_value_t *root, ts__enc *e)
{
    memset(e, 0, sizeof(*e));
    if (root == NULL)
        return TS_EINVAL;
    pstate ps = {0};
    psize(root, 1, &ps);
    if (ps.too_deep || ps.meta_len > UINT32_MAX)
        return TS_EINVAL;
    size_t head_len = ts__align_up(TS_REC_HDR_SIZE + ps.meta_len, TS__ALIGN);
    /* One allocation: the head, then the segment table (head_len keeps it aligned). */
    if (ps.nsegs > (SIZE_MAX - head_len) / sizeof(ts__seg))
        return TS_EINVAL;
    e->head = ts__calloc(1, head_len + ps.nsegs * sizeof(ts__seg));
    if (e->head == NULL)
        return TS_ENOMEM;
    if (ps.nsegs > 0)
        e->segs = (ts__seg *)(void *)(e->head + head_len);
    wstate ws = {.m = e->head + TS_REC_HDR_SIZE, .segs = e->segs};
    pwrite(root, &ws);
    e->head[0] = TS_REC_MAGIC0;
    e->head[1] = TS_REC_MAGIC1;
    e->head[2] = TS_REC_MAGIC2;
    e->head[3] = TS_REC_MAGIC3;
    ts__put_u32le(e->head + 4, (uint32_t)ps.meta_len);
    ts__put_u64le(e->head + 8, ws.data_pos);
    e->head_len = head_len;
    e->nsegs = ws.nsegs;
    e->total = head_len + ws.data_pos;
    return 0;
}

void ts__enc_free(ts__enc *e)
{
    ts__free(e->head); /* the segment table lives in the same allocation */
    memset(e, 0, sizeof(*e));
}

void ts__enc_copy(const ts__enc *e, uint8_t *out)
{
    memcpy(out, e->head, e->head_len);
    size_t pos = e->head_len;
    for (size_t i = 0; i < e->nsegs; i++) {
        if (e->segs[i].len > 0)
            memcpy(out + pos, e->segs[i].ptr, e->segs[i].len);
        pos += e->segs[i].len;
        memset(out + pos, 0, e->segs[i].pad_after);
        pos += e->segs[i].pad_after;
    }
}

int ts__record_encode(const ts_value_t *root, uint8_t **out, size_t *len)
{
    ts__enc e;
    int rc = ts__record_plan(root, &e);
    if (rc != 0)
        return rc;
    uint8_t *buf = ts__malloc_aligned(e.total);
    if (buf == NULL) {
        ts__enc_free(&e);
        return TS_ENOMEM;
    }
    ts__enc_copy(&e, buf);
    *out = buf;
    *len = e.total;
    ts__enc_free(&e);
    return 0;
}
