/*
 * The parameter server on the client (include/tensorshare/ps.h): one blocking request each.
 * PS_CREATE's, EMB_CREATE's and PS_PULL's bodies are encoded by src/msg_ps.c into the request's
 * flat buffer; PS_PUSH, EMB_PULL and EMB_PUSH are uploads like PUT (the name and fixed fields in
 * the request's head, the record sent from the caller's memory). reply.c parses the replies
 * (a bin state, STALE_GRADIENT's too, into res; ITEMS into res.items).
 *
 * Threads: blocking calls of a client like any other (any thread, never from a callback).
 */
#include "tensorshare/ps.h"

#include "internal.h"

#include "msg.h"
#include "slot.h"

/* Check a name: at most 255 bytes. 0 and *len, or the error. */
static int ps_check_name(const char *s, size_t *len)
{
    if (s == NULL)
        return ts__fail(TS_EINVAL, "no name");
    size_t n = strlen(s);
    if (n > TS_MAX_NAME_LEN)
        return ts__fail(TS_ENAMETOOLONG, "name of %zu bytes (at most %d)", n, TS_MAX_NAME_LEN);
    *len = n;
    return 0;
}

/*
 * Make an upload of op on name with record item (borrowed: its memory must stay valid until the
 * request is done) and fixed fields (may be NULL). The request, or NULL with *rc.
 */
static ts__req *ps_upload_req(ts_client_t *c, uint8_t op, const char *name, const uint8_t *fixed,
                              size_t fixed_len, const ts_value_t *item, int *rc)
{
    ts__req *r = ts__api_req_new(c, TS__K_BLOCK, op, name, rc);
    if (r == NULL)
        return NULL;
    if (fixed_len > 0)
        memcpy(ts__req_upload_fixed(r), fixed, fixed_len);
    *rc = ts__api_attach_record(c, r, item, TS_BORROW);
    if (*rc != 0) {
        ts__req_free(r);
        *rc = ts__fail(*rc, "the %s record cannot be encoded: %s", ts__op_name(op),
                       ts__record_plan_why(*rc));
        return NULL;
    }
    return r;
}

/* Run an upload of op on name with record item (borrowed) and fixed fields (may be NULL). */
static int ps_upload(ts_client_t *c, uint8_t op, const char *name, const uint8_t *fixed,
                     size_t fixed_len, const ts_value_t *item, ts__req **done)
{
    int rc;
    *done = NULL;
    ts__req *r = ps_upload_req(c, op, name, fixed, fixed_len, item, &rc);
    if (r == NULL)
        return rc;
    return ts__api_run_blocking(c, r, done);
}

void ts_ps_options_init(ts_ps_options_t *o)
{
    memset(o, 0, sizeof(*o));
    o->optimizer = TS_PS_SGD;
    o->mode = TS_PS_ASYNC;
    o->sync_k = 1;
    o->lr = 0.01;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
}

int ts_ps_create(ts_client_t *c, const char *name, const ts_ps_options_t *o, uint64_t *version)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts_ps_options_t def;
    if (o == NULL) {
        ts_ps_options_init(&def);
        o = &def;
    }
    ts__msg_ps_create_req m = {.name = (const uint8_t *)name,
                               .optimizer = (uint8_t)o->optimizer,
                               .mode = (uint8_t)o->mode,
                               .flags = (uint8_t)((o->lr_staleness ? TS_PS_FLAG_LR_STALENESS : 0) |
                                                  (o->keep ? TS_PS_FLAG_KEEP : 0)),
                               .sync_k = o->sync_k,
                               .tolerance = o->tolerance,
                               .lr = o->lr,
                               .beta1 = o->beta1,
                               .beta2 = o->beta2,
                               .eps = o->eps};
    if ((rc = ps_check_name(name, &m.name_len)) != 0)
        return rc;
    if ((unsigned)o->optimizer > TS_PS_ADAM || (unsigned)o->mode > TS_PS_SYNC)
        return ts__fail(TS_EINVAL, "unknown optimizer or mode");
    size_t len = ts__msg_ps_create_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_PS_CREATE, len, NULL, NULL, 0, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_ps_create_req_encode(r->flat, len, &m, &n); /* the name was checked */
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    if (version != NULL)
        *version = done->res.version;
    ts__req_free(done);
    return 0;
}

int ts_ps_push(ts_client_t *c, const char *name, const ts_tensor_t *grad, uint64_t base_version,
               double scale, uint64_t *version)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl;
    if ((rc = ps_check_name(name, &nl)) != 0)
        return rc;
    if (grad == NULL || grad->dtype != TS_FLOAT32)
        return ts__fail(TS_EINVAL, "the gradient must be a float32 tensor");
    ts_value_t *v = ts_tensor_new(grad->dtype, grad->ndim, grad->shape, grad->data, TS_BORROW);
    if (v == NULL)
        return ts__fail(TS_EINVAL, "the gradient is not a valid tensor");
    uint8_t fixed[TS_MSG_PS_PUSH_FIXED];
    ts__msg_ps_push_fixed f = {.base_version = base_version, .scale = scale};
    ts__msg_ps_push_fixed_encode(fixed, &f);
    ts__req *done;
    rc = ps_upload(c, TS_OP_PS_PUSH, name, fixed, sizeof(fixed), v, &done);
    ts_value_free(v);
    if (done == NULL)
        return rc;
    /* Success, or STALE_GRADIENT with the parameter's current version. */
    uint64_t cur = done->res.version;
    ts__req_free(done);
    if (version != NULL)
        *version = cur;
    if (rc == TS_ESTALE)
        ts__fail(rc,
                 "parameter '%s' is at version %llu: the gradient (computed on %llu) lags by "
                 "more than the tolerance",
                 name, (unsigned long long)cur, (unsigned long long)base_version);
    return rc;
}

int ts_ps_pull(ts_client_t *c, const char *name, uint64_t if_newer_than, ts_items_t **out,
               uint64_t *version)
{
    c = ts__route(c, name);
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    ts__msg_ps_pull_req m = {.name = (const uint8_t *)name, .if_newer_than = if_newer_than};
    if ((rc = ps_check_name(name, &m.name_len)) != 0)
        return rc;
    size_t len = ts__msg_ps_pull_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_PS_PULL, len, NULL, NULL, 0, &rc);
    if (r == NULL)
        return rc;
    (void)ts__msg_ps_pull_req_encode(r->flat, len, &m, &n);
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    ts_items_t *items = done->res.items;
    done->res.items = NULL;
    ts__req_free(done);
    if (version != NULL)
        *version = ts_items_version(items);
    if (ts_items_count(items) == 0) {
        ts_items_free(items);
        items = NULL;
    }
    if (out != NULL)
        *out = items;
    else
        ts_items_free(items);
    return 0;
}

void ts_emb_options_init(ts_emb_options_t *o, uint32_t dim)
{
    memset(o, 0, sizeof(*o));
    o->dim = dim;
    o->optimizer = TS_PS_SGD;
    o->init = TS_PS_INIT_UNIFORM;
    o->lr = 0.01;
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
    o->init_scale = 0.05;
}

/* An EMB_CREATE request of table name with settings o for client c, or NULL with *rc. */
static ts__req *emb_create_req(ts_client_t *c, const char *name, const ts_emb_options_t *o, int *rc)
{
    ts__msg_ps_create_req m = {.name = (const uint8_t *)name,
                               .dim = o->dim,
                               .optimizer = (uint8_t)o->optimizer,
                               .init = (uint8_t)o->init,
                               .seed = o->seed,
                               .num_ids = o->num_ids,
                               .lr = o->lr,
                               .beta1 = o->beta1,
                               .beta2 = o->beta2,
                               .eps = o->eps,
                               .init_scale = o->init_scale};
    m.name_len = strlen(name); /* checked by the caller */
    size_t len = ts__msg_emb_create_req_size(m.name_len), n;
    ts__req *r = ts__api_flat_req(c, TS__K_BLOCK, TS_OP_EMB_CREATE, len, NULL, NULL, 0, rc);
    if (r != NULL)
        (void)ts__msg_emb_create_req_encode(r->flat, len, &m, &n);
    return r;
}

/* The checks every table call makes on its name and settings. */
static int emb_check(const char *name, const ts_emb_options_t *o)
{
    size_t nl;
    int rc = ps_check_name(name, &nl);
    if (rc != 0)
        return rc;
    if (o == NULL)
        return ts__fail(TS_EINVAL, "no table settings");
    if ((unsigned)o->optimizer > TS_PS_ADAM || (unsigned)o->init > TS_PS_INIT_NORMAL)
        return ts__fail(TS_EINVAL, "unknown optimizer or initializer");
    return 0;
}

/*
 * Run the requests rs[0..n) on the shard clients cs[0..n) at once and check them: 0 when all
 * succeeded, else the first failure with ts_last_error() naming its shard by its address (and
 * its position in the cluster's list) when cs are a cluster's shards (cluster), or as the server
 * gave it otherwise. Every request that came back stays in rs (NULL for one given up).
 */
static int emb_run_all(ts_client_t *const *cs, ts__req **rs, const size_t *shard, size_t n,
                       int cluster)
{
    int rcs[TS_SHARD_MAX];
    ts__api_run_blocking_all(cs, rs, n, rcs);
    for (size_t i = 0; i < n; i++) {
        if (rcs[i] == 0)
            continue;
        const char *why = rs[i] != NULL && rs[i]->msg != NULL ? rs[i]->msg : ts_strerror(rcs[i]);
        if (!cluster)
            return ts__fail(rcs[i], "%s", why);
        const char *addr = cs[i]->address != NULL ? cs[i]->address : "?";
        return ts__fail(rcs[i], "the cluster's shard at %s (%zu in its list): %s", addr, shard[i],
                        why);
    }
    return 0;
}

/* ts_emb_create on cluster handle h: EMB_CREATE on every shard at once. */
static int emb_create_cluster(ts_client_t *h, const char *name, const ts_emb_options_t *o)
{
    int rc = ts__cluster_enter(h);
    if (rc != 0)
        return ts__fail(rc, "the client is closing");
    ts_client_t *cs[TS_SHARD_MAX];
    ts__req *rs[TS_SHARD_MAX];
    size_t idx[TS_SHARD_MAX] = {0};
    size_t k = ts__cluster_shard_clients(h, cs);
    for (size_t i = 0; i < k; i++) {
        idx[i] = i;
        rs[i] = rc == 0 ? emb_create_req(cs[i], name, o, &rc) : NULL;
    }
    if (rc == 0)
        rc = emb_run_all(cs, rs, idx, k, 1);
    for (size_t i = 0; i < k; i++)
        ts__req_free(rs[i]);
    ts__cluster_leave(h);
    return rc;
}

int ts_emb_create(ts_client_t *c, const char *name, const ts_emb_options_t *o)
{
    if (c != NULL && c->cl != NULL) {
        int rc = ts__api_check_call(c, 1);
        if (rc == 0)
            rc = emb_check(name, o);
        return rc != 0 ? rc : emb_create_cluster(c, name, o);
    }
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    if ((rc = emb_check(name, o)) != 0)
        return rc;
    ts__req *r = emb_create_req(c, name, o, &rc);
    if (r == NULL)
        return rc;
    ts__req *done;
    if ((rc = ts__api_run_blocking(c, r, &done)) != 0)
        return rc;
    ts__req_free(done);
    return 0;
}

/* splitmix64's finalizer, to spread ids over the dedup hash. */
static uint64_t ps_mix(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/*
 * The distinct ids of ids[0..n) in first-seen order (*uniq, *nu) and, for each i, the index of
 * ids[i] among them (*pos). All three arrays are the caller's (ts__free). 0 or TS_ENOMEM.
 */
static int dedup_ids(const int64_t *ids, size_t n, int64_t **uniq, size_t *nu, size_t **pos)
{
    size_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    size_t *slot = ts__malloc(cap * sizeof(size_t));
    int64_t *u = ts__malloc((n ? n : 1) * sizeof(int64_t));
    size_t *p = ts__malloc((n ? n : 1) * sizeof(size_t));
    if (slot == NULL || u == NULL || p == NULL) {
        ts__free(slot);
        ts__free(u);
        ts__free(p);
        return TS_ENOMEM;
    }
    for (size_t i = 0; i < cap; i++)
        slot[i] = SIZE_MAX;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        size_t h = (size_t)ps_mix((uint64_t)ids[i]) & (cap - 1);
        while (slot[h] != SIZE_MAX && u[slot[h]] != ids[i])
            h = (h + 1) & (cap - 1);
        if (slot[h] == SIZE_MAX) {
            slot[h] = k;
            u[k++] = ids[i];
        }
        p[i] = slot[h];
    }
    ts__free(slot);
    *uniq = u;
    *nu = k;
    *pos = p;
    return 0;
}

/*
 * Rows spread by id over a cluster (docs/PS.md "Several daemons"): the row of id x lives on the
 * shard that owns the slot of x's 8 little-endian bytes, the cluster's one routing (src/slot.c).
 */
static uint16_t emb_id_slot(int64_t id)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)id >> (8 * i));
    return ts__slot(b, sizeof(b));
}

/*
 * The per-shard arrays of one split call, on the heap: a cluster may have TS_SHARD_MAX shards,
 * which would make them tens of KiB on the caller's stack.
 */
typedef struct emb_shards {
    ts_client_t *cs[TS_SHARD_MAX];     /* the shard clients, the owning shards first */
    size_t off[TS_SHARD_MAX + 1];      /* shard j's ids are grouped[off[j]..off[j + 1]) */
    size_t fill[TS_SHARD_MAX];         /* grouping: the next free place of each shard */
    ts_client_t *req_cs[TS_SHARD_MAX]; /* the requests sent: their clients, */
    ts__req *rs[TS_SHARD_MAX];         /* the requests, */
    size_t idx[TS_SHARD_MAX];          /* the shard (index into cs) of each, */
    ts_value_t *vals[TS_SHARD_MAX];    /* and the records they borrow */
} emb_shards;

/*
 * ids[0..n) grouped by shard, the order within each shard kept: the shard clients (s->cs, *k of
 * them), and for each shard j its ids at (*grouped)[s->off[j]..s->off[j+1]) whose places in ids
 * are (*from)[s->off[j]..s->off[j+1]). grouped and from are the caller's (ts__free). 0 or
 * TS_ENOMEM.
 */
static int emb_group(ts_client_t *h, const int64_t *ids, size_t n, emb_shards *s, size_t *k,
                     int64_t **grouped, size_t **from)
{
    ts_client_t **cs = s->cs;
    size_t *off = s->off, *count = s->fill;
    size_t nk = ts__cluster_shard_clients(h, cs);
    uint16_t *sh = ts__malloc((n ? n : 1) * sizeof(uint16_t));
    int64_t *g = ts__malloc((n ? n : 1) * sizeof(int64_t));
    size_t *f = ts__malloc((n ? n : 1) * sizeof(size_t));
    if (sh == NULL || g == NULL || f == NULL) {
        ts__free(sh);
        ts__free(g);
        ts__free(f);
        return TS_ENOMEM;
    }
    memset(count, 0, sizeof(s->fill));
    for (size_t i = 0; i < n; i++) {
        ts_client_t *to = ts__cluster_route_slot(h, emb_id_slot(ids[i]));
        size_t j = 0;
        while (j < nk && cs[j] != to)
            j++;
        if (j == nk && nk < TS_SHARD_MAX) /* a shard learned since the list was taken */
            cs[nk++] = to;
        if (j >= TS_SHARD_MAX)
            j = 0; /* cannot happen: every owner is among the handle's shards */
        sh[i] = (uint16_t)j;
        count[j]++;
    }
    off[0] = 0;
    for (size_t j = 0; j < nk; j++)
        off[j + 1] = off[j] + count[j];
    size_t *fill = s->fill;
    memcpy(fill, off, nk * sizeof(size_t));
    for (size_t i = 0; i < n; i++) {
        size_t at = fill[sh[i]]++;
        g[at] = ids[i];
        f[at] = i;
    }
    ts__free(sh);
    *k = nk;
    *grouped = g;
    *from = f;
    return 0;
}

/*
 * ts_emb_pull or ts_emb_push (grads non-NULL) on cluster handle h: the ids split by shard, one
 * EMB_PULL or EMB_PUSH per shard that holds any of them, all sent at once, the rows put back in
 * the caller's order. A pull sends each id once; a push sends every row (each shard sums the rows
 * of a duplicate id in the order they come, as one daemon would). *version: the highest of the
 * versions the shards asked answered.
 */
static int emb_split(ts_client_t *h, const char *name, const int64_t *ids, size_t n, uint32_t dim,
                     const float *grads, double scale, float *out, uint64_t *version)
{
    int rc = ts__cluster_enter(h);
    if (rc != 0)
        return ts__fail(rc, "the client is closing");
    int push = grads != NULL;
    int64_t *uniq = NULL, *grouped = NULL;
    size_t nu = n, *pos = NULL, *from = NULL;
    float *gg = NULL;
    const float **rowp = NULL;
    size_t k = 0, m = 0;
    emb_shards *s = ts__calloc(1, sizeof(*s));
    if (s == NULL) {
        ts__cluster_leave(h);
        return ts__fail(TS_ENOMEM, NULL);
    }
    ts_client_t **cs = s->cs, **rc_cs = s->req_cs;
    size_t *off = s->off, *idx = s->idx;
    ts__req **rs = s->rs;
    ts_value_t **vals = s->vals;
    const int64_t *send = ids;
    if (!push) {
        if (dedup_ids(ids, n, &uniq, &nu, &pos) != 0) {
            rc = ts__fail(TS_ENOMEM, NULL);
            goto out;
        }
        send = uniq;
        if ((rowp = ts__malloc((nu ? nu : 1) * sizeof(*rowp))) == NULL) {
            rc = ts__fail(TS_ENOMEM, NULL);
            goto out;
        }
    }
    if (emb_group(h, send, nu, s, &k, &grouped, &from) != 0) {
        rc = ts__fail(TS_ENOMEM, NULL);
        goto out;
    }
    if (push) {
        /* The gradients in the grouped order: one contiguous record per shard. */
        size_t bytes;
        if (__builtin_mul_overflow(nu, (size_t)dim * sizeof(float), &bytes) ||
            (gg = ts__malloc(bytes ? bytes : 1)) == NULL) {
            rc = ts__fail(TS_ENOMEM, NULL);
            goto out;
        }
        for (size_t g = 0; g < nu; g++)
            memcpy(gg + g * dim, grads + from[g] * dim, dim * sizeof(float));
    }
    uint8_t fixed[TS_MSG_EMB_PUSH_FIXED];
    ts__msg_emb_push_fixed_encode(fixed, scale);
    for (size_t j = 0; j < k && rc == 0; j++) {
        size_t cnt = off[j + 1] - off[j];
        if (cnt == 0 && !(nu == 0 && j == 0))
            continue; /* nothing for this shard (an empty call still asks one, for its version) */
        int64_t s1[1] = {(int64_t)cnt}, s2[2] = {(int64_t)cnt, (int64_t)dim};
        ts_value_t *v = ts_tensor_new(TS_INT64, 1, s1, grouped + off[j], TS_BORROW);
        if (push && v != NULL) {
            ts_value_t *list = ts_list_new();
            if (list == NULL || ts_list_push(list, v) != 0) {
                ts_value_free(v);
                ts_value_free(list);
                v = NULL;
            } else {
                v = list;
                if (ts_list_push(list, ts_tensor_new(TS_FLOAT32, 2, s2, gg + off[j] * dim,
                                                     TS_BORROW)) != 0) {
                    ts_value_free(list);
                    v = NULL;
                }
            }
        }
        if (v == NULL) {
            rc = ts__fail(TS_ENOMEM, NULL);
            break;
        }
        vals[m] = v;
        rc_cs[m] = cs[j];
        idx[m] = j;
        rs[m] = ps_upload_req(cs[j], push ? TS_OP_EMB_PUSH : TS_OP_EMB_PULL, name,
                              push ? fixed : NULL, push ? sizeof(fixed) : 0, v, &rc);
        m++;
    }
    if (rc == 0)
        rc = emb_run_all(rc_cs, rs, idx, m, 1);
    uint64_t top = 0;
    for (size_t i = 0; rc == 0 && i < m; i++) {
        if (push) {
            top = rs[i]->res.version > top ? rs[i]->res.version : top;
            continue;
        }
        size_t j = idx[i], cnt = off[j + 1] - off[j];
        ts_items_t *items = rs[i]->res.items;
        const ts_value_t *root = ts_items_count(items) == 1 ? ts_items_at(items, 0) : NULL;
        const ts_tensor_t *t = root != NULL ? ts_value_tensor(root) : NULL;
        if (t == NULL || t->dtype != TS_FLOAT32 || t->ndim != 2 || t->shape[0] != (int64_t)cnt ||
            t->shape[1] != (int64_t)dim) {
            rc = ts__fail(TS_EINVAL,
                          "table '%s' on shard %zu answered rows of another shape than %zu x %u",
                          name, j, cnt, dim);
            break;
        }
        uint64_t v = ts_items_version(items);
        top = v > top ? v : top;
        /* Row g of this shard is distinct id from[off + g]. */
        const float *rows = t->data;
        for (size_t g = 0; g < cnt; g++)
            rowp[from[off[j] + g]] = rows + g * dim;
    }
    if (rc == 0 && !push) {
        for (size_t i = 0; i < n; i++)
            memcpy(out + i * dim, rowp[pos[i]], dim * sizeof(float));
    }
    if (rc == 0 && version != NULL)
        *version = top;
    for (size_t i = 0; i < m; i++) {
        ts__req_free(rs[i]);
        ts_value_free(vals[i]);
    }
out:
    ts__free(s);
    ts__free(rowp);
    ts__free(uniq);
    ts__free(pos);
    ts__free(grouped);
    ts__free(from);
    ts__free(gg);
    ts__cluster_leave(h);
    return rc;
}

int ts_emb_pull(ts_client_t *c, const char *name, const int64_t *ids, size_t n, uint32_t dim,
                float *out, uint64_t *version)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl;
    if ((rc = ps_check_name(name, &nl)) != 0)
        return rc;
    if ((n > 0 && (ids == NULL || out == NULL)) || dim == 0)
        return ts__fail(TS_EINVAL, "ids, out and a dim above 0 are needed");
    if (c->cl != NULL)
        return emb_split(c, name, ids, n, dim, NULL, 0, out, version);
    int64_t *uniq;
    size_t nu, *pos;
    if (dedup_ids(ids, n, &uniq, &nu, &pos) != 0)
        return ts__fail(TS_ENOMEM, NULL);
    int64_t shape[1] = {(int64_t)nu};
    ts_value_t *v = ts_tensor_new(TS_INT64, 1, shape, uniq, TS_BORROW);
    ts__req *done = NULL;
    if (v == NULL) {
        rc = ts__fail(TS_ENOMEM, NULL);
    } else {
        rc = ps_upload(c, TS_OP_EMB_PULL, name, NULL, 0, v, &done);
        ts_value_free(v);
    }
    if (rc == 0) {
        ts_items_t *items = done->res.items;
        const ts_value_t *root = ts_items_count(items) == 1 ? ts_items_at(items, 0) : NULL;
        const ts_tensor_t *t = root != NULL ? ts_value_tensor(root) : NULL;
        if (t == NULL || t->dtype != TS_FLOAT32 || t->ndim != 2 || t->shape[0] != (int64_t)nu ||
            t->shape[1] != (int64_t)dim) {
            rc = ts__fail(TS_EINVAL, "table '%s' answered rows of another shape than %zu x %u",
                          name, nu, dim);
        } else {
            const float *rows = t->data;
            for (size_t i = 0; i < n; i++)
                memcpy(out + i * dim, rows + pos[i] * dim, dim * sizeof(float));
            if (version != NULL)
                *version = ts_items_version(items);
        }
    }
    if (done != NULL)
        ts__req_free(done);
    ts__free(uniq);
    ts__free(pos);
    return rc;
}

int ts_emb_push(ts_client_t *c, const char *name, const int64_t *ids, size_t n, uint32_t dim,
                const float *grads, double scale, uint64_t *version)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl;
    if ((rc = ps_check_name(name, &nl)) != 0)
        return rc;
    if ((n > 0 && (ids == NULL || grads == NULL)) || dim == 0)
        return ts__fail(TS_EINVAL, "ids, grads and a dim above 0 are needed");
    if (c->cl != NULL)
        return emb_split(c, name, ids, n, dim, grads != NULL ? grads : (const float *)"", scale,
                         NULL, version);
    int64_t s1[1] = {(int64_t)n}, s2[2] = {(int64_t)n, (int64_t)dim};
    ts_value_t *list = ts_list_new();
    if (list == NULL || ts_list_push(list, ts_tensor_new(TS_INT64, 1, s1, ids, TS_BORROW)) != 0 ||
        ts_list_push(list, ts_tensor_new(TS_FLOAT32, 2, s2, grads, TS_BORROW)) != 0) {
        ts_value_free(list);
        return ts__fail(TS_ENOMEM, NULL);
    }
    uint8_t fixed[TS_MSG_EMB_PUSH_FIXED];
    ts__msg_emb_push_fixed_encode(fixed, scale);
    ts__req *done;
    rc = ps_upload(c, TS_OP_EMB_PUSH, name, fixed, sizeof(fixed), list, &done);
    ts_value_free(list);
    if (rc != 0)
        return rc;
    if (version != NULL)
        *version = done->res.version;
    ts__req_free(done);
    return 0;
}

int ts_emb_versions(ts_client_t *c, const char *name, uint64_t *versions, size_t cap, size_t *n)
{
    int rc = ts__api_check_call(c, 1);
    if (rc != 0)
        return rc;
    size_t nl;
    if ((rc = ps_check_name(name, &nl)) != 0)
        return rc;
    if (versions == NULL && cap > 0)
        return ts__fail(TS_EINVAL, "no room for the versions");
    int cluster = c->cl != NULL;
    if (cluster && (rc = ts__cluster_enter(c)) != 0)
        return ts__fail(rc, "the client is closing");
    ts_client_t *cs[TS_SHARD_MAX];
    ts__req *rs[TS_SHARD_MAX];
    size_t idx[TS_SHARD_MAX] = {0};
    size_t k = 1;
    cs[0] = c;
    if (cluster)
        k = ts__cluster_shard_clients(c, cs);
    /* A pull of no ids makes no row and answers the table's version. */
    int64_t none = 0, shape[1] = {0};
    ts_value_t *v = ts_tensor_new(TS_INT64, 1, shape, &none, TS_BORROW);
    if (v == NULL)
        rc = ts__fail(TS_ENOMEM, NULL);
    for (size_t i = 0; i < k; i++) {
        idx[i] = i;
        rs[i] = rc == 0 ? ps_upload_req(cs[i], TS_OP_EMB_PULL, name, NULL, 0, v, &rc) : NULL;
    }
    if (rc == 0)
        rc = emb_run_all(cs, rs, idx, k, cluster);
    for (size_t i = 0; rc == 0 && i < k && i < cap; i++)
        versions[i] = ts_items_version(rs[i]->res.items);
    if (rc == 0 && n != NULL)
        *n = k;
    for (size_t i = 0; i < k; i++)
        ts__req_free(rs[i]);
    ts_value_free(v);
    if (cluster)
        ts__cluster_leave(c);
    return rc;
}
