/*
 * The parameter server (ps.h, docs/PS.md).
 *
 * A dense parameter is a plain bin holding one item whose record's root is a float32 tensor:
 * PEEK, GET, WAIT, LISTEN and snapshots see it like any bin. PS_CREATE attaches a ps_param to
 * the name (optimizer, mode, slot tensors, the sync accumulator). A PS_PUSH is queued on its
 * parameter; one job at a time per parameter runs on the thread pool, copies the current record
 * into a new item, applies the queued gradients to the copy (and to the slots, which only the
 * running job touches), and hands back to the loop, which links the new item into the bin with
 * a new version (a replacement: readers holding the old item keep it, whole). So no reader ever
 * sees a half-applied step and the loop never does arithmetic.
 *
 * An embedding table (ps_emb) is not a bin: its rows live in one array indexed through an
 * open-addressing hash of ids. Its pulls and pushes queue on it in arrival order and run, one
 * job at a time, on the thread pool; a pull's reply is a new item filled by the job.
 *
 * Memory: slots, accumulators, rows and the hash count against --max-memory as overhead
 * (tsd_store_charge), new items through the store's reservation like uploads.
 */
#include "ps.h"

#include <math.h>
#include <stdlib.h>

#include "msg.h"
#include "record.h"
#include "snapfile.h"
#include "stream.h"
#include "table.h"

/* Room for a printable bin name in messages (255 bytes, each at most 4 bytes of UTF-8). */
#define PS_NAME_CAP (TS_MAX_NAME_LEN * 4 + 1)
/* ids per EMB_PULL or EMB_PUSH at most (2^24): bounds one job's scratch memory. */
#define TSD_PS_MAX_IDS ((uint64_t)1 << 24)
/* Smallest hash capacity of a table (slots, a power of two). */
#define TSD_PS_HASH_MIN 1024u

/* ---------------------------------------------------------------------------------------------
 * State
 */

typedef struct ps_wait ps_wait;

/* A request waiting for a job: a push (dense or rows) or a rows pull. */
struct ps_wait {
    ps_wait *next;          /* in its object's queue, arrival order */
    ps_wait *aprev, *anext; /* in the server's list of all waits */
    tsd_conn *c;            /* NULL once the connection has gone */
    uint32_t rid;
    uint8_t op;
    uint16_t status; /* the job's verdict, TS_ST_OK or an error */
    char msg[160];   /* the message of an error verdict */
    tsd_item *item;  /* the uploaded record (reserved in the store), or NULL once dropped */
    double scale;
    double lr; /* PS_PUSH: the learning rate after staleness scaling */
    /* Inside item: the gradient (PS_PUSH, EMB_PUSH) and the ids (EMB_PULL, EMB_PUSH). */
    const float *grad;
    const int64_t *ids;
    uint64_t n;          /* ids */
    tsd_item *reply;     /* EMB_PULL: the reply record, filled by the job */
    uint64_t reply_over; /* its overhead, charged until it is answered (its bytes: orphaned) */
    uint64_t new_rows;   /* rows the job created for this request */
    uint64_t version;    /* the version of the answer */
    uint32_t pending;    /* PS_PUSH sync: gradients in the step being formed when answered */
};

typedef struct ps_param {
    tsd_hnode node;
    tsd_server *srv;
    uint8_t opt, mode, flags;
    uint32_t k, tolerance;
    double lr, beta1, beta2, eps;
    uint64_t numel;
    float *slot1, *slot2; /* momentum / Adam m; Adam v */
    uint64_t adam_t;      /* Adam steps taken */
    float *acc;           /* sync: the sum of this step's scaled gradients */
    uint32_t acc_n;       /* sync: gradients in acc */
    uint64_t steps;       /* optimizer steps applied */
    uint64_t ring_ver[TSD_PS_RING], ring_step[TSD_PS_RING];
    uint32_t ring_n, ring_head; /* entries, next slot */
    ps_wait *q_head, *q_tail;   /* queued pushes, not yet in a job */
    ps_wait *job;               /* the pushes of the running job */
    ps_wait *round;             /* sync: pushes in acc, answered when their step applies */
    int busy;
    uv_work_t work;
    tsd_item *job_old;  /* the record the job starts from */
    tsd_item *job_new;  /* the copy it writes; NULL when it applied nothing */
    uint64_t job_extra; /* job_new's overhead (buffer rounding, header), reserved until stored */
    int job_used;
    size_t data_off; /* the tensor data's offset in the record */
    uint64_t job_steps;
    uint64_t cost;         /* bytes charged */
    uint64_t load_version; /* loading a snapshot: the bin's version its state belongs to */
} ps_param;

typedef struct ps_emb {
    tsd_hnode node;
    tsd_server *srv;
    uint32_t dim;
    uint8_t opt, init;
    uint64_t seed, num_ids;
    double lr, beta1, beta2, eps, init_scale;
    uint32_t stride; /* floats per row: the value and the slots */
    /* The hash: keys (-1 = empty) and row indexes; cap a power of two. */
    int64_t *keys;
    uint32_t *idx;
    uint64_t cap, count;
    float *rows;     /* count rows of stride floats */
    uint32_t *steps; /* Adam: steps per row */
    uint64_t rows_cap;
    uint64_t version;
    ps_wait *q_head, *q_tail;
    ps_wait *job;
    int busy;
    uv_work_t work;
    uint64_t cost;     /* bytes charged for the arrays */
    uint64_t pending;  /* bytes charged ahead for the running job */
    int64_t *load_ids; /* loading a snapshot: the id of each row, until the hash is built */
} ps_emb;

typedef struct tsd_ps {
    tsd_htab params;
    tsd_htab embs;
    ps_wait *all_head;
    /*
     * Snapshots (tsd_ps_quiesce): no job starts while a snapshot waits to be taken or its copies
     * run; requests queue meanwhile and the jobs start when the last copy is back.
     */
    uint32_t running;         /* jobs of parameters and tables on the thread pool */
    int quiet_req;            /* a snapshot waits for the running jobs to end */
    uint32_t copying;         /* copies of a snapshot not yet back on the loop */
    int dying;                /* tsd_ps_free ran while copies were out: the last one frees */
    void (*quiet_cb)(void *); /* called when the last running job ends */
    void *quiet_arg;
    ps_param *ld_p;  /* loading: the parameter whose slots come next, or NULL */
    ps_emb *ld_t;    /* loading: the table whose arrays come next, or NULL */
    uint32_t ld_arr; /* loading: arrays of it handed out so far */
} tsd_ps;

/* 1 while jobs must not start (a snapshot is being taken). */
static int ps_paused(const tsd_server *srv)
{
    return srv->ps != NULL && (srv->ps->quiet_req || srv->ps->copying > 0);
}

/*
 * A job ended: when a snapshot waits for the running jobs and this was the last, call it. The
 * caller's last statement, as the call may free every parameter and table (the final snapshot
 * frees them right after it is taken).
 */
static void ps_quiet_check(tsd_server *srv)
{
    tsd_ps *ps = srv->ps;
    if (ps == NULL || ps->running > 0 || ps->quiet_cb == NULL)
        return;
    void (*cb)(void *) = ps->quiet_cb;
    void *arg = ps->quiet_arg;
    ps->quiet_cb = NULL;
    ps->quiet_arg = NULL;
    cb(arg);
}

static tsd_ps *ps_state(tsd_server *srv)
{
    if (srv->ps == NULL) {
        tsd_ps *ps = ts__calloc(1, sizeof(*ps));
        if (ps == NULL)
            return NULL;
        if (tsd_htab_init(&ps->params) != 0 || tsd_htab_init(&ps->embs) != 0) {
            tsd_htab_free(&ps->params);
            ts__free(ps);
            return NULL;
        }
        srv->ps = ps;
    }
    return srv->ps;
}

static ps_param *param_find(tsd_server *srv, const uint8_t *name, size_t len)
{
    if (srv->ps == NULL)
        return NULL;
    return (ps_param *)(void *)tsd_htab_find(&srv->ps->params, name, len);
}

static ps_emb *emb_find(tsd_server *srv, const uint8_t *name, size_t len)
{
    if (srv->ps == NULL)
        return NULL;
    return (ps_emb *)(void *)tsd_htab_find(&srv->ps->embs, name, len);
}

/* ---------------------------------------------------------------------------------------------
 * Records
 */

/* The receive buffer of a decoded item borrows the item's bytes: nothing to free. */
static void ps_keep_bytes(void *data, size_t len)
{
    (void)data;
    (void)len;
}

/* A tensor found in a record. */
typedef struct ps_tensor {
    uint8_t dtype;
    int ndim;
    int64_t shape[TS_MAX_NDIM];
    uint64_t numel;
    uint8_t *data;
} ps_tensor;

static void tensor_fill(const ts_tensor_t *t, ps_tensor *out)
{
    out->dtype = (uint8_t)t->dtype;
    out->ndim = t->ndim;
    memcpy(out->shape, t->shape, sizeof(out->shape));
    out->numel = (uint64_t)ts_tensor_numel(t);
    out->data = t->data;
}

/*
 * The tensors of a validated record at rec: its root when it is a tensor (n = 1), or the n
 * tensors of its root list. 0, TS_ENOMEM, or TS_ETYPE when the record has another shape.
 */
static int record_tensors(uint8_t *rec, size_t len, ps_tensor *out, size_t n)
{
    ts__rbuf *rb = ts__rbuf_new(rec, len, ps_keep_bytes);
    if (rb == NULL)
        return TS_ENOMEM;
    ts_value_t *root = ts__record_decode(rb, 0, len, TS_MAX_DEPTH, TS_MAX_NDIM);
    ts__rbuf_unref(rb);
    if (root == NULL)
        return TS_ENOMEM;
    int rc = 0;
    if (n == 1 && ts_value_type(root) == TS_TYPE_TENSOR) {
        tensor_fill(ts_value_tensor(root), out);
    } else if (n > 1 && ts_value_type(root) == TS_TYPE_LIST && ts_value_len(root) == n) {
        for (size_t i = 0; i < n && rc == 0; i++) {
            const ts_value_t *v = ts_list_at(root, i);
            if (ts_value_type(v) != TS_TYPE_TENSOR)
                rc = TS_ETYPE;
            else
                tensor_fill(ts_value_tensor(v), &out[i]);
        }
    } else {
        rc = TS_ETYPE;
    }
    ts__record_tree_free(root);
    return rc;
}

/* 1 when a and b have the same shape. */
static int same_shape(const ps_tensor *a, const ps_tensor *b)
{
    if (a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return 0;
    return 1;
}

/* Drop an uploaded record: its reservation and its reference (loop thread). */
static void drop_upload(tsd_server *srv, tsd_item *it)
{
    if (it == NULL)
        return;
    tsd_store_unreserve(&srv->store, tsd_item_len(it));
    tsd_item_unref(it);
}

/* ---------------------------------------------------------------------------------------------
 * Waits
 */

static ps_wait *wait_new(tsd_server *srv, tsd_conn *c, const ts__hdr *h, tsd_item *item)
{
    ps_wait *w = ts__calloc(1, sizeof(*w));
    if (w == NULL)
        return NULL;
    tsd_ps *ps = srv->ps;
    w->c = c;
    w->rid = h->request_id;
    w->op = h->opcode;
    w->item = item;
    w->anext = ps->all_head;
    if (ps->all_head != NULL)
        ps->all_head->aprev = w;
    ps->all_head = w;
    return w;
}

static void wait_free(tsd_server *srv, ps_wait *w)
{
    tsd_ps *ps = srv->ps;
    if (w->aprev != NULL)
        w->aprev->anext = w->anext;
    else
        ps->all_head = w->anext;
    if (w->anext != NULL)
        w->anext->aprev = w->aprev;
    drop_upload(srv, w->item);
    tsd_store_uncharge(srv, NULL, w->reply_over);
    if (w->reply != NULL)
        tsd_item_unref(w->reply);
    ts__free(w);
}

/* Answer w with its verdict (when its connection is still there), then free it. */
static void wait_answer(tsd_server *srv, ps_wait *w)
{
    tsd_conn *c = w->c;
    if (c != NULL) {
        if (w->status != TS_ST_OK) {
            tsd_reply_err(c, w->op, w->rid, w->status, "%s", w->msg);
        } else if (w->op == TS_OP_EMB_PULL) {
            tsd_item *rec = w->reply;
            w->reply = NULL;
            uint64_t rec_len = tsd_item_len(rec);
            /* From here the copy counts as bytes kept alive by a reply only (orphaned). */
            tsd_store_uncharge(srv, NULL, w->reply_over);
            w->reply_over = 0;
            uint64_t body_len = ts__items_head_size(1) + rec_len + ts__msg_items_pad(rec_len);
            size_t ihead = (size_t)ts__items_head_size(1);
            uint8_t *q = NULL;
            if (tsd_out_begin(c, w->op, w->rid) == 0 &&
                tsd_out_hdr(c, w->op, w->rid, TS_ST_OK, body_len) == 0)
                q = tsd_out_bytes(c, ihead);
            if (q != NULL) {
                size_t hlen;
                (void)ts__msg_items_head_encode(q, ihead, w->version, 1, 1, &rec_len, &hlen);
                (void)tsd_out_item(c, rec, 0); /* consumes our reference, also on failure */
            } else {
                tsd_item_unref(rec);
            }
        } else {
            tsd_reply_state(c, w->op, w->rid, TS_ST_OK, w->version, w->pending);
        }
    }
    wait_free(srv, w);
}

static void wait_fail(ps_wait *w, uint16_t status, const char *msg)
{
    w->status = status;
    /* Messages are cut to the wait's room (an error message is at most that long anyway). */
    size_t n = strnlen(msg, sizeof(w->msg) - 1);
    memcpy(w->msg, msg, n);
    w->msg[n] = '\0';
}

/* Append w to a queue given by its head and tail. */
static void queue_push(ps_wait **head, ps_wait **tail, ps_wait *w)
{
    w->next = NULL;
    if (*tail != NULL)
        (*tail)->next = w;
    else
        *head = w;
    *tail = w;
}

/* ---------------------------------------------------------------------------------------------
 * Dense parameters
 */

/* Bytes of a parameter's slots and accumulator for its optimizer and mode. */
static uint64_t param_arrays(uint8_t opt, uint8_t mode, uint64_t numel)
{
    uint64_t n = 0;
    if (opt == TS_PS_OPT_MOMENTUM)
        n = 1;
    else if (opt == TS_PS_OPT_ADAM)
        n = 2;
    if (mode == TS_PS_MODE_SYNC)
        n++;
    return n * numel * sizeof(float);
}

static void param_free_arrays(ps_param *p)
{
    ts__free(p->slot1);
    ts__free(p->slot2);
    ts__free(p->acc);
    p->slot1 = p->slot2 = p->acc = NULL;
}

/* Remember that version v was published after step count steps. */
static void ring_add(ps_param *p, uint64_t v, uint64_t steps)
{
    p->ring_ver[p->ring_head] = v;
    p->ring_step[p->ring_head] = steps;
    p->ring_head = (p->ring_head + 1) % TSD_PS_RING;
    if (p->ring_n < TSD_PS_RING)
        p->ring_n++;
}

/*
 * Steps applied since version base: 0 for base 0 (unknown: no check) or a base at or past the
 * bin's version cur; the difference of step counts for a remembered version; TSD_PS_RING for
 * an older or unknown one.
 */
static uint64_t staleness(const ps_param *p, uint64_t base, uint64_t cur)
{
    if (base == 0 || base == cur)
        return 0;
    if (base > cur)
        return TSD_PS_RING; /* a version the parameter never had: unknown */
    for (uint32_t i = 0; i < p->ring_n; i++) {
        uint32_t j = (p->ring_head + TSD_PS_RING - 1 - i) % TSD_PS_RING;
        if (p->ring_ver[j] == base)
            return p->steps - p->ring_step[j];
    }
    return TSD_PS_RING;
}

/*
 * The parameter's value: its bin's one item when its root is a float32 tensor of numel
 * elements. 0 with *it and *t; else an INVALID/NOT_FOUND status with msg written.
 */
static uint16_t param_value(tsd_server *srv, const uint8_t *name, size_t nl, uint64_t numel,
                            tsd_item **it, ps_tensor *t, char *msg, size_t cap)
{
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    if (bin == NULL) {
        snprintf(msg, cap, "no such bin");
        return TS_ST_NOT_FOUND;
    }
    if (bin->n_items != 1 || tsd_bin_is_tensor(bin)) {
        snprintf(msg, cap, "a parameter's bin holds exactly one item (this one holds %u%s)",
                 bin->n_items, tsd_bin_is_tensor(bin) ? ", a tensor bin" : "");
        return TS_ST_INVALID;
    }
    int rc = record_tensors(tsd_item_data(bin->head), tsd_item_len(bin->head), t, 1);
    if (rc == TS_ENOMEM) {
        snprintf(msg, cap, "tensord is out of memory reading the parameter");
        return TS_ST_OUT_OF_MEMORY;
    }
    if (rc != 0 || t->dtype != TS_FLOAT32) {
        snprintf(msg, cap, "a parameter's record is one float32 tensor (its root)");
        return TS_ST_INVALID;
    }
    if (numel != 0 && t->numel != numel) {
        snprintf(msg, cap, "the parameter now has %llu elements, %llu when it was created",
                 (unsigned long long)t->numel, (unsigned long long)numel);
        return TS_ST_INVALID;
    }
    *it = bin->head;
    return TS_ST_OK;
}

static int finite_all(const float *g, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (!isfinite(g[i]))
            return 0;
    return 1;
}

/* One optimizer step on w (n floats) with gradient g times gs (g NULL: nothing). */
static void dense_step(ps_param *p, float *w, const float *g, float gs, double lr)
{
    uint64_t n = p->numel;
    float flr = (float)lr;
    switch (p->opt) {
    case TS_PS_OPT_SUM:
        for (uint64_t i = 0; i < n; i++)
            w[i] += gs * g[i];
        break;
    case TS_PS_OPT_SGD:
        for (uint64_t i = 0; i < n; i++)
            w[i] -= flr * (gs * g[i]);
        break;
    case TS_PS_OPT_MOMENTUM: {
        float mu = (float)p->beta1;
        for (uint64_t i = 0; i < n; i++) {
            p->slot1[i] = mu * p->slot1[i] + gs * g[i];
            w[i] -= flr * p->slot1[i];
        }
        break;
    }
    case TS_PS_OPT_ADAM: {
        p->adam_t++;
        double bc1 = 1.0 - pow(p->beta1, (double)p->adam_t);
        double bc2 = 1.0 - pow(p->beta2, (double)p->adam_t);
        /* 1 - beta in double, rounded once: 1.0f - (float)0.999 is 1.3e-5 off 0.001. */
        float b1 = (float)p->beta1, b2 = (float)p->beta2, eps = (float)p->eps;
        float c1 = (float)(1.0 - p->beta1), c2 = (float)(1.0 - p->beta2);
        float a = (float)(lr / bc1), rbc2 = (float)(1.0 / bc2);
        for (uint64_t i = 0; i < n; i++) {
            float gi = gs * g[i];
            p->slot1[i] = b1 * p->slot1[i] + c1 * gi;
            p->slot2[i] = b2 * p->slot2[i] + c2 * gi * gi;
            w[i] -= a * p->slot1[i] / (sqrtf(p->slot2[i] * rbc2) + eps);
        }
        break;
    }
    default:
        break;
    }
}

/*
 * Thread pool: apply the job's pushes in order. Touches only the job's waits (their gradients
 * are immutable items), the new item, the slots and the accumulator, which the loop does not
 * touch while p->busy.
 */
static void param_work(uv_work_t *req)
{
    ps_param *p = req->data;
    uint8_t *rec = tsd_item_data(p->job_new);
    float *w = (float *)(void *)(rec + p->data_off);
    p->job_used = 0;
    p->job_steps = 0;
    for (ps_wait *x = p->job; x != NULL; x = x->next) {
        if (!finite_all(x->grad, p->numel)) {
            wait_fail(x, TS_ST_INVALID,
                      "the gradient holds a NaN or an infinity: refused, nothing changed");
            continue;
        }
        if (!p->job_used) {
            memcpy(rec, tsd_item_data(p->job_old), tsd_item_len(p->job_old));
            p->job_used = 1;
        }
        if (p->mode == TS_PS_MODE_ASYNC) {
            dense_step(p, w, x->grad, (float)x->scale, x->lr);
            p->job_steps++;
            continue;
        }
        float s = (float)x->scale;
        if (p->acc_n == 0) {
            for (uint64_t i = 0; i < p->numel; i++)
                p->acc[i] = s * x->grad[i];
        } else {
            for (uint64_t i = 0; i < p->numel; i++)
                p->acc[i] += s * x->grad[i];
        }
        p->acc_n++;
        if (p->acc_n == p->k) {
            dense_step(p, w, p->acc, 1.0f / (float)p->k, p->lr);
            p->acc_n = 0;
            p->job_steps++;
            x->pending = UINT32_MAX; /* marks the push that completed a step */
        }
    }
}

static void param_kick(tsd_server *srv, ps_param *p);

/*
 * The parameter's bin no longer holds its tensor (deleted, or replaced by a PUT of something
 * else): the sync step being formed cannot be applied, so its pushes are answered with the error
 * and the accumulator starts over. Loop thread, never while a job runs (the job owns acc).
 */
static void round_fail(tsd_server *srv, ps_param *p, uint16_t st, const char *msg)
{
    if (p->busy)
        return;
    while (p->round != NULL) {
        ps_wait *x = p->round;
        p->round = x->next;
        wait_fail(x, st, msg);
        wait_answer(srv, x);
    }
    p->acc_n = 0;
}

void tsd_ps_bin_changed(tsd_server *srv, const uint8_t *name, size_t len)
{
    if (srv->ps == NULL)
        return;
    ps_param *p = param_find(srv, name, len);
    if (p == NULL || p->busy || p->round == NULL)
        return; /* a step being applied checks the bin again when it is done */
    tsd_item *it;
    ps_tensor t;
    char msg[160], full[240];
    uint16_t st = param_value(srv, name, len, p->numel, &it, &t, msg, sizeof(msg));
    if (st == TS_ST_OK || st == TS_ST_OUT_OF_MEMORY)
        return; /* still one float32 tensor of its size: the step goes on */
    snprintf(full, sizeof(full), "the parameter's bin changed while its step was forming: %s", msg);
    round_fail(srv, p, st, full);
}

/* Loop thread: publish the job's result, answer its pushes, start the next job. */
static void param_done(uv_work_t *req, int status)
{
    ps_param *p = req->data;
    tsd_server *srv = p->srv;
    (void)status;
    p->busy = 0;
    srv->ps->running--;
    uint64_t version = 0;
    tsd_item *it = p->job_new;
    p->job_new = NULL;
    size_t len = tsd_item_len(it);
    if (p->job_used && p->job_steps > 0) {
        version = tsd_server_next_version(srv);
        tsd_bin *bin = tsd_store_add(&srv->store, p->node.name, p->node.name_len, it, 1, version);
        if (bin == NULL) {
            tsd_store_unreserve(&srv->store, len);
            tsd_item_unref(it);
            for (ps_wait *x = p->job; x != NULL; x = x->next)
                if (x->status == TS_ST_OK)
                    wait_fail(x, TS_ST_OUT_OF_MEMORY, "tensord is out of memory publishing");
            version = 0;
        } else {
            /* An item in a data-dir file gets its header now, as a PUT's does. */
            (void)tsd_datadir_commit(srv, it, p->node.name, p->node.name_len, TSD_DATADIR_REPLACE);
            p->steps += p->job_steps;
            ring_add(p, version, p->steps);
            tsd_notify_change(srv, p->node.name, p->node.name_len, version, 1, TS_NOTE_PUT);
        }
    } else {
        tsd_store_unreserve(&srv->store, len);
        tsd_item_unref(it);
    }
    /* Stored, its overhead is counted as the store's own; dropped, it is gone. */
    tsd_store_unreserve(&srv->store, p->job_extra);
    p->job_extra = 0;
    tsd_item_unref(p->job_old);
    p->job_old = NULL;
    /* Answer the job's pushes; a sync push waits for the step it is part of. */
    ps_wait *x = p->job;
    p->job = NULL;
    uint64_t cur = version;
    if (cur == 0) {
        tsd_bin *bin = tsd_store_find(&srv->store, p->node.name, p->node.name_len);
        cur = bin != NULL ? bin->version : 0;
    }
    while (x != NULL) {
        ps_wait *next = x->next;
        drop_upload(srv, x->item);
        x->item = NULL;
        x->grad = NULL;
        if (x->status != TS_ST_OK || p->mode == TS_PS_MODE_ASYNC) {
            x->version = cur;
            x->pending = 0;
            wait_answer(srv, x);
        } else {
            int completes = x->pending == UINT32_MAX;
            x->next = p->round;
            p->round = x;
            if (completes) {
                /* The step is applied: every push of it is answered with its version. */
                ps_wait *r = p->round;
                p->round = NULL;
                while (r != NULL) {
                    ps_wait *rn = r->next;
                    r->version = cur;
                    r->pending = 0;
                    wait_answer(srv, r);
                    r = rn;
                }
            }
        }
        x = next;
    }
    param_kick(srv, p);
    /* Replies queued outside a read callback go out now, not at the next tick. */
    tsd_server_flush(srv);
    ps_quiet_check(srv);
}

/* Start a job for p's queued pushes when none runs. */
static void param_kick(tsd_server *srv, ps_param *p)
{
    if (p->busy || p->q_head == NULL || ps_paused(srv))
        return;
    char msg[200];
    tsd_item *old;
    ps_tensor t;
    uint16_t st =
        param_value(srv, p->node.name, p->node.name_len, p->numel, &old, &t, msg, sizeof(msg));
    tsd_item *nu = NULL;
    size_t len = 0;
    int drc = 1;
    if (st == TS_ST_OK) {
        len = tsd_item_len(old);
        /*
         * With --data-dir the new value goes to a file as a PUT's record does (at least
         * --data-min bytes), so that the parameter's bin survives a restart; a refusal answers
         * the pushes as a PUT's is answered. Its pages count against --max-disk, not
         * --max-memory: its length and overhead are reserved without a check, for param_done.
         */
        drc = tsd_datadir_alloc(srv, len, &nu);
    }
    if (st == TS_ST_OK && drc < 0) {
        tsd_datadir_refusal(srv, drc, len, msg, sizeof(msg));
        srv->stats.oom_rejections++;
        st = TS_ST_OUT_OF_MEMORY;
        nu = NULL;
    } else if (st == TS_ST_OK && drc == 0) {
        srv->store.reserved += len + tsd_item_overhead(nu);
    } else if (st == TS_ST_OK) {
        if (tsd_store_reserve(&srv->store, len) != 0) {
            srv->stats.oom_rejections++;
            st = TS_ST_OUT_OF_MEMORY;
            snprintf(msg, sizeof(msg),
                     "memory limit reached (--max-memory): the new value of "
                     "the parameter needs %zu bytes",
                     len);
        } else if ((nu = tsd_item_new(len)) == NULL) {
            tsd_store_unreserve(&srv->store, len);
            srv->stats.out_of_memory++;
            st = TS_ST_OUT_OF_MEMORY;
            snprintf(msg, sizeof(msg), "tensord is out of memory: no item for the new value");
        } else if (tsd_store_reserve(&srv->store, tsd_item_overhead(nu)) != 0) {
            /* What the new value's buffer really takes, as for an upload (conn.c, item_store). */
            tsd_store_unreserve(&srv->store, len);
            srv->stats.oom_rejections++;
            st = TS_ST_OUT_OF_MEMORY;
            snprintf(msg, sizeof(msg),
                     "memory limit reached (--max-memory): the new value of the parameter needs "
                     "%llu bytes with its buffer",
                     (unsigned long long)(len + tsd_item_overhead(nu)));
            tsd_item_unref(nu);
            nu = NULL;
        }
    }
    if (st != TS_ST_OK) {
        /* Nothing can be applied now: every queued push is refused, nothing changed. */
        while (p->q_head != NULL) {
            ps_wait *x = p->q_head;
            p->q_head = x->next;
            wait_fail(x, st, msg);
            wait_answer(srv, x);
        }
        p->q_tail = NULL;
        round_fail(srv, p, st, msg);
        return;
    }
    p->job = p->q_head;
    p->q_head = p->q_tail = NULL;
    p->job_old = old;
    tsd_item_ref(old);
    p->job_new = nu;
    p->job_extra = tsd_item_overhead(nu);
    p->data_off = (size_t)(t.data - tsd_item_data(old));
    p->busy = 1;
    srv->ps->running++;
    p->work.data = p;
    if (uv_queue_work(srv->loop, &p->work, param_work, param_done) != 0) {
        /* Cannot happen with a live loop; run it here rather than lose the pushes. */
        param_work(&p->work);
        param_done(&p->work, 0);
    }
}

/*
 * A PS_ request names a stream or a replay table: answer INVALID as a PUT or a GET of such a name
 * is answered ("bin 'x' is a stream", "bin 'x' is a replay table") and return 1; else 0 (nothing
 * sent). A parameter is a plain bin, and names are one namespace, so neither is ever one.
 * Embedding tables have names of their own (docs/PS.md) and are not checked.
 */
static int refuse_kind(tsd_conn *c, uint8_t op, uint32_t rid, const uint8_t *name, size_t nl)
{
    return tsd_stream_refuse_name(c, op, rid, name, nl) ||
           tsd_table_refuse_name(c, op, rid, name, nl);
}

/* Check the optimizer settings shared by parameters and tables; NULL or what is wrong. */
static const char *bad_optimizer(const ts__msg_ps_create_req *q)
{
    if (q->optimizer >= TS_PS_OPT_COUNT_)
        return "unknown optimizer";
    if (!isfinite(q->lr) || q->lr < 0)
        return "the learning rate must be finite and at least 0";
    if ((q->optimizer == TS_PS_OPT_MOMENTUM || q->optimizer == TS_PS_OPT_ADAM) &&
        !(q->beta1 >= 0 && q->beta1 < 1))
        return "beta1 (momentum) must be in [0, 1)";
    if (q->optimizer == TS_PS_OPT_ADAM &&
        (!(q->beta2 >= 0 && q->beta2 < 1) || !(q->eps > 0) || !isfinite(q->eps)))
        return "Adam needs beta2 in [0, 1) and a finite eps above 0";
    return NULL;
}

/*
 * Names a parameter's or embedding table's hash node: the name bytes are copied into storage
 * (the object's own tail, name_len bytes) and hashed. Creation and snapshot restore of both kinds
 * name their nodes this way; the caller has checked len against the name limit (a uint8_t).
 */
static void node_name_set(tsd_hnode *node, uint8_t *storage, const uint8_t *name, size_t len)
{
    node->name = storage;
    node->name_len = (uint8_t)len;
    if (len > 0)
        memcpy(node->name, name, len);
    node->hash = tsd_hash(name, len);
}

static void op_ps_create(tsd_conn *c, const ts__hdr *h, const ts__msg_ps_create_req *q)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    char pn[PS_NAME_CAP], msg[200];
    tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
    const char *bad = bad_optimizer(q);
    if (bad == NULL &&
        (q->mode >= TS_PS_MODE_COUNT_ || (q->flags & ~(TS_PS_FLAGS_KNOWN | TS_PS_FLAG_KEEP)) != 0))
        bad = "unknown mode or flags";
    if (bad == NULL && q->mode == TS_PS_MODE_SYNC &&
        (q->sync_k < 1 || q->sync_k > TSD_PS_MAX_K || q->tolerance >= TSD_PS_RING))
        bad = "a sync parameter needs 1 to 65536 gradients per step and a tolerance below 1024";
    if (bad != NULL) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "PS_CREATE %s: %s", pn, bad);
        return;
    }
    if (ps_state(srv) == NULL) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    if (refuse_kind(c, op, rid, q->name, q->name_len))
        return;
    tsd_item *it;
    ps_tensor t;
    uint16_t st = param_value(srv, q->name, q->name_len, 0, &it, &t, msg, sizeof(msg));
    if (st != TS_ST_OK) {
        tsd_reply_err(c, op, rid, st, "PS_CREATE %s: %s", pn, msg);
        return;
    }
    ps_param *p = param_find(srv, q->name, q->name_len);
    if (p != NULL && (q->flags & TS_PS_FLAG_KEEP)) {
        /*
         * KEEP: a parameter that already exists (restored from a snapshot, or made by another
         * worker) keeps its slots and counts when its settings are the same; nothing changes.
         */
        uint8_t flags = q->flags & TS_PS_FLAGS_KNOWN;
        uint32_t k = q->mode == TS_PS_MODE_SYNC ? q->sync_k : 1;
        if (p->opt != q->optimizer || p->mode != q->mode || p->flags != flags || p->k != k ||
            p->tolerance != q->tolerance || p->lr != q->lr || p->beta1 != q->beta1 ||
            p->beta2 != q->beta2 || p->eps != q->eps || p->numel != t.numel) {
            tsd_reply_err(c, op, rid, TS_ST_INVALID,
                          "PS_CREATE %s: KEEP: the parameter exists with other settings or "
                          "another size",
                          pn);
            return;
        }
        tsd_bin *kb = tsd_store_find(&srv->store, q->name, q->name_len);
        tsd_reply_state(c, op, rid, TS_ST_OK, kb->version, kb->n_items);
        return;
    }
    if (p != NULL && (p->busy || p->q_head != NULL || p->round != NULL)) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "PS_CREATE %s: pushes are in flight or a sync step is being formed", pn);
        return;
    }
    /* A snapshot's copy may be reading the slots this would free. */
    if (p != NULL && srv->ps->copying > 0) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID,
                      "PS_CREATE %s: a snapshot is copying the parameter's state; try again", pn);
        return;
    }
    uint64_t arrays = param_arrays(q->optimizer, q->mode, t.numel);
    uint64_t block = tsd_heap_block(sizeof(*p) + q->name_len);
    /*
     * A parameter created again gives its old slots back before the new ones are counted, so
     * that replacing Adam by Adam needs no room for both.
     */
    uint64_t old_arrays = p != NULL ? p->cost - block : 0;
    uint64_t need = arrays + (p == NULL ? block : 0);
    tsd_store_uncharge(srv, NULL, old_arrays);
    if (tsd_store_charge(srv, NULL, need) != 0) {
        (void)tsd_store_charge(srv, NULL, old_arrays); /* it was counted a moment ago: fits */
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                      "memory limit reached (--max-memory): the parameter's slots need %llu "
                      "bytes",
                      (unsigned long long)need);
        return;
    }
    int fresh = p == NULL;
    if (fresh) {
        p = ts__calloc(1, sizeof(*p) + q->name_len);
        if (p == NULL) {
            tsd_store_uncharge(srv, NULL, need);
            tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
            return;
        }
        p->srv = srv;
        node_name_set(&p->node, (uint8_t *)(p + 1), q->name, q->name_len);
    } else {
        param_free_arrays(p); /* their charge was given back above */
    }
    p->cost = block;
    size_t bytes = (size_t)t.numel * sizeof(float);
    int fail = 0;
    if (q->optimizer == TS_PS_OPT_MOMENTUM || q->optimizer == TS_PS_OPT_ADAM)
        fail |= (p->slot1 = ts__calloc(1, bytes ? bytes : 1)) == NULL;
    if (q->optimizer == TS_PS_OPT_ADAM)
        fail |= (p->slot2 = ts__calloc(1, bytes ? bytes : 1)) == NULL;
    if (q->mode == TS_PS_MODE_SYNC)
        fail |= (p->acc = ts__calloc(1, bytes ? bytes : 1)) == NULL;
    if (fail) {
        /* An old parameter's settings are gone too: it is dropped rather than half-made. */
        param_free_arrays(p);
        tsd_store_uncharge(srv, NULL, arrays + block);
        if (!fresh)
            tsd_htab_remove(&srv->ps->params, &p->node);
        ts__free(p);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    p->cost += arrays;
    p->opt = q->optimizer;
    p->mode = q->mode;
    p->flags = q->flags & TS_PS_FLAGS_KNOWN; /* KEEP is the request's, not the parameter's */
    p->k = q->mode == TS_PS_MODE_SYNC ? q->sync_k : 1;
    p->tolerance = q->tolerance;
    p->lr = q->lr;
    p->beta1 = q->beta1;
    p->beta2 = q->beta2;
    p->eps = q->eps;
    p->numel = t.numel;
    p->adam_t = 0;
    p->acc_n = 0;
    p->steps = 0;
    p->ring_n = p->ring_head = 0;
    tsd_bin *bin = tsd_store_find(&srv->store, q->name, q->name_len);
    ring_add(p, bin->version, 0);
    if (fresh)
        tsd_htab_insert(&srv->ps->params, &p->node);
    /* New settings are a change the next snapshot must hold (SAVE skips an unchanged server). */
    (void)tsd_server_next_version(srv);
    tsd_reply_state(c, op, rid, TS_ST_OK, bin->version, bin->n_items);
}

static void op_ps_pull(tsd_conn *c, const ts__hdr *h, const ts__msg_ps_pull_req *q)
{
    tsd_server *srv = c->srv;
    if (refuse_kind(c, h->opcode, h->request_id, q->name, q->name_len))
        return;
    tsd_bin *bin = tsd_store_find(&srv->store, q->name, q->name_len);
    if (bin == NULL || bin->n_items == 0) {
        char pn[PS_NAME_CAP];
        tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_NOT_FOUND, "no such bin: %s", pn);
        return;
    }
    if (tsd_out_begin(c, h->opcode, h->request_id) != 0)
        return;
    /* Not newer: an ITEMS body without items, carrying the current version. */
    uint32_t n = bin->version > q->if_newer_than ? 1 : 0;
    tsd_item *it = bin->tail;
    uint64_t len = n ? tsd_item_len(it) : 0;
    uint64_t body_len = ts__items_head_size(n) + len + (n ? ts__msg_items_pad(len) : 0);
    if (tsd_out_hdr(c, h->opcode, h->request_id, TS_ST_OK, body_len) != 0)
        return;
    size_t head = (size_t)ts__items_head_size(n);
    uint8_t *p = tsd_out_bytes(c, head);
    if (p == NULL)
        return;
    size_t hlen;
    (void)ts__msg_items_head_encode(p, head, bin->version, n, bin->n_items, n ? &len : NULL, &hlen);
    if (n)
        (void)tsd_out_item(c, it, 1);
}

static void ps_push(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                    const uint8_t *fixed, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    char pn[PS_NAME_CAP], msg[200];
    if (refuse_kind(c, op, rid, name, nl)) {
        drop_upload(srv, item);
        return;
    }
    tsd_name_printable(name, nl, pn, sizeof(pn));
    ps_param *p = param_find(srv, name, nl);
    if (p == NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND, "PS_PUSH: %s is not a parameter (PS_CREATE)",
                      pn);
        return;
    }
    ts__msg_ps_push_fixed f;
    ts__msg_ps_push_fixed_decode(fixed, &f);
    tsd_item *cur_it = NULL;
    ps_tensor cur, g;
    uint16_t st = param_value(srv, name, nl, p->numel, &cur_it, &cur, msg, sizeof(msg));
    if (st == TS_ST_OK) {
        int rc = record_tensors(tsd_item_data(item), tsd_item_len(item), &g, 1);
        if (rc == TS_ENOMEM) {
            st = TS_ST_OUT_OF_MEMORY;
            snprintf(msg, sizeof(msg), "tensord is out of memory reading the gradient");
        } else if (rc != 0 || g.dtype != TS_FLOAT32 || !same_shape(&g, &cur)) {
            st = TS_ST_INVALID;
            snprintf(msg, sizeof(msg),
                     "the gradient must be one float32 tensor (the record's root) of the "
                     "parameter's shape");
        } else if (!isfinite(f.scale)) {
            st = TS_ST_INVALID;
            snprintf(msg, sizeof(msg), "the scale must be finite");
        }
    }
    if (st != TS_ST_OK) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, st, "PS_PUSH %s: %s", pn, msg);
        /* A gradient's own fault leaves the step being formed alone; a broken parameter not. */
        if (cur_it == NULL && st != TS_ST_OUT_OF_MEMORY)
            round_fail(srv, p, st, msg);
        return;
    }
    tsd_bin *bin = tsd_store_find(&srv->store, name, nl);
    uint64_t s = staleness(p, f.base_version, bin->version);
    if (p->mode == TS_PS_MODE_SYNC && s > p->tolerance) {
        drop_upload(srv, item);
        tsd_reply_state(c, op, rid, TS_ST_STALE_GRADIENT, bin->version, p->acc_n);
        return;
    }
    ps_wait *w = wait_new(srv, c, h, item);
    if (w == NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    w->grad = (const float *)(const void *)g.data;
    w->scale = f.scale;
    w->lr = p->lr;
    if ((p->flags & TS_PS_FLAG_LR_STALENESS) && s > 1)
        w->lr = p->lr / (double)s;
    queue_push(&p->q_head, &p->q_tail, w);
    param_kick(srv, p);
}

/* ---------------------------------------------------------------------------------------------
 * Embedding tables
 */

/* splitmix64's finalizer: a bijective mix of 64 bits. */
static uint64_t mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/*
 * A uniform double in [0, 1) that depends only on (seed, id, counter): a counter-based
 * generator, so any daemon (or the client, or a test) computes the same row for the same id
 * without shared state. docs/PS.md states the formula.
 */
static double ps_uniform(uint64_t seed, int64_t id, uint64_t counter)
{
    uint64_t z = mix64(mix64(mix64(seed) ^ (uint64_t)id) ^ counter);
    return (double)(z >> 11) * 0x1.0p-53;
}

/* Fill a new row's values (dim floats) for id by t's initializer. */
static void row_init(const ps_emb *t, int64_t id, float *row)
{
    for (uint32_t j = 0; j < t->dim; j++) {
        double v = 0;
        if (t->init == TS_PSW_INIT_UNIFORM) {
            v = (2.0 * ps_uniform(t->seed, id, j) - 1.0) * t->init_scale;
        } else if (t->init == TS_PSW_INIT_NORMAL) {
            /* Box-Muller from two draws of the row's column: 1 - u is in (0, 1]. */
            double u1 = 1.0 - ps_uniform(t->seed, id, 2 * (uint64_t)j + (1ull << 32));
            double u2 = ps_uniform(t->seed, id, 2 * (uint64_t)j + 1 + (1ull << 32));
            v = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2) * t->init_scale;
        }
        row[j] = (float)v;
    }
}

/* The capacities the arrays have for count rows: rows a power of two (at least 64), the hash
 * twice that (at least TSD_PS_HASH_MIN), so its load stays at most one half. */
static uint64_t rows_cap_for(uint64_t count)
{
    uint64_t c = 64;
    while (c < count)
        c *= 2;
    return c;
}

static uint64_t hash_cap_for(uint64_t count)
{
    uint64_t c = TSD_PS_HASH_MIN;
    while (c < 2 * count)
        c *= 2;
    return c;
}

/*
 * Bytes of t's arrays (what is charged against --max-memory) once they have room for count
 * rows: their capacities now, or those count rows need where larger (count 0: as they are).
 */
static uint64_t emb_bytes(const ps_emb *t, uint64_t count)
{
    uint64_t rc = t->rows_cap, hc = t->cap;
    if (count > 0 && rows_cap_for(count) > rc)
        rc = rows_cap_for(count);
    if (count > 0 && hash_cap_for(count) > hc)
        hc = hash_cap_for(count);
    uint64_t row =
        (uint64_t)t->stride * sizeof(float) + (t->opt == TS_PS_OPT_ADAM ? sizeof(uint32_t) : 0);
    return rc * row + hc * (sizeof(int64_t) + sizeof(uint32_t));
}

/* Grow t's arrays (thread pool, while t->busy) to hold count rows. 0 or TS_ENOMEM. */
static int emb_reserve(ps_emb *t, uint64_t count)
{
    uint64_t rc = rows_cap_for(count);
    if (rc > t->rows_cap) {
        float *r = ts__realloc(t->rows, (size_t)(rc * t->stride * sizeof(float)));
        if (r == NULL)
            return TS_ENOMEM;
        t->rows = r;
        if (t->opt == TS_PS_OPT_ADAM) {
            uint32_t *s = ts__realloc(t->steps, (size_t)(rc * sizeof(uint32_t)));
            if (s == NULL)
                return TS_ENOMEM; /* rows grew; rows_cap stays, so it is retried */
            t->steps = s;
        }
        t->rows_cap = rc;
    }
    uint64_t hc = hash_cap_for(count);
    if (hc > t->cap) {
        int64_t *k = ts__malloc((size_t)(hc * sizeof(int64_t)));
        uint32_t *v = ts__malloc((size_t)(hc * sizeof(uint32_t)));
        if (k == NULL || v == NULL) {
            ts__free(k);
            ts__free(v);
            return TS_ENOMEM;
        }
        for (uint64_t i = 0; i < hc; i++)
            k[i] = -1;
        for (uint64_t i = 0; i < t->cap; i++) {
            if (t->keys[i] < 0)
                continue;
            uint64_t h = mix64((uint64_t)t->keys[i]) & (hc - 1);
            while (k[h] >= 0)
                h = (h + 1) & (hc - 1);
            k[h] = t->keys[i];
            v[h] = t->idx[i];
        }
        ts__free(t->keys);
        ts__free(t->idx);
        t->keys = k;
        t->idx = v;
        t->cap = hc;
    }
    return 0;
}

/* The row index of id, created (initialised) when missing; room was reserved. */
static uint32_t emb_row(ps_emb *t, int64_t id, uint64_t *created)
{
    uint64_t h = mix64((uint64_t)id) & (t->cap - 1);
    while (t->keys[h] >= 0) {
        if (t->keys[h] == id)
            return t->idx[h];
        h = (h + 1) & (t->cap - 1);
    }
    uint32_t r = (uint32_t)t->count++;
    t->keys[h] = id;
    t->idx[h] = r;
    float *row = t->rows + (size_t)r * t->stride;
    row_init(t, id, row);
    memset(row + t->dim, 0, (size_t)(t->stride - t->dim) * sizeof(float));
    if (t->steps != NULL)
        t->steps[r] = 0;
    (*created)++;
    return r;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/*
 * The ids of ids[0..n) that t does not hold, each counted once (n, an upper bound, when there is
 * no memory to tell repeats apart). Only reads t: on the thread pool while t runs a job, or on
 * the loop while it does not.
 */
static uint64_t emb_missing(const ps_emb *t, const int64_t *ids, uint64_t n)
{
    if (n == 0)
        return 0;
    int64_t *miss = ts__malloc((size_t)n * sizeof(int64_t));
    if (miss == NULL)
        return n;
    uint64_t m = 0;
    for (uint64_t i = 0; i < n; i++) {
        int held = 0;
        if (t->cap > 0) {
            uint64_t h = mix64((uint64_t)ids[i]) & (t->cap - 1);
            while (t->keys[h] >= 0 && t->keys[h] != ids[i])
                h = (h + 1) & (t->cap - 1);
            held = t->keys[h] >= 0;
        }
        if (!held)
            miss[m++] = ids[i];
    }
    uint64_t distinct = 0;
    if (m > 0) {
        qsort(miss, (size_t)m, sizeof(int64_t), cmp_i64);
        distinct = 1;
        for (uint64_t i = 1; i < m; i++)
            distinct += miss[i] != miss[i - 1];
    }
    ts__free(miss);
    return distinct;
}

/* Rows t must have room for before n more ids: n when its arrays hold them all anyway (nothing
 * grows), else the ids it lacks (emb_missing). */
static uint64_t emb_new_rows(const ps_emb *t, const int64_t *ids, uint64_t n)
{
    uint64_t want = t->count + n;
    if (t->cap > 0 && rows_cap_for(want) <= t->rows_cap && hash_cap_for(want) <= t->cap)
        return n;
    return emb_missing(t, ids, n);
}

/* Check a request's ids against t's range; NULL or the message ("" when msg is NULL). */
static const char *bad_ids(const ps_emb *t, const int64_t *ids, uint64_t n, char *msg, size_t cap)
{
    for (uint64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (t->num_ids != 0 && (uint64_t)ids[i] >= t->num_ids)) {
            if (msg == NULL)
                return "";
            snprintf(msg, cap, "id %lld (index %llu) is out of range [0, %llu)", (long long)ids[i],
                     (unsigned long long)i,
                     (unsigned long long)(t->num_ids ? t->num_ids : (uint64_t)INT64_MAX));
            return msg;
        }
    }
    return NULL;
}

/* One optimizer step on row r with the merged gradient g (dim floats, scaled already). */
static void row_step(ps_emb *t, uint32_t r, const float *g)
{
    float *w = t->rows + (size_t)r * t->stride;
    uint32_t d = t->dim;
    float lr = (float)t->lr;
    switch (t->opt) {
    case TS_PS_OPT_SUM:
        for (uint32_t j = 0; j < d; j++)
            w[j] += g[j];
        break;
    case TS_PS_OPT_SGD:
        for (uint32_t j = 0; j < d; j++)
            w[j] -= lr * g[j];
        break;
    case TS_PS_OPT_MOMENTUM: {
        float mu = (float)t->beta1;
        float *v = w + d;
        for (uint32_t j = 0; j < d; j++) {
            v[j] = mu * v[j] + g[j];
            w[j] -= lr * v[j];
        }
        break;
    }
    case TS_PS_OPT_ADAM: {
        uint32_t st = ++t->steps[r];
        double bc1 = 1.0 - pow(t->beta1, (double)st);
        double bc2 = 1.0 - pow(t->beta2, (double)st);
        float b1 = (float)t->beta1, b2 = (float)t->beta2, eps = (float)t->eps;
        float c1 = (float)(1.0 - t->beta1), c2 = (float)(1.0 - t->beta2); /* as dense_step's */
        float a = (float)(t->lr / bc1), rbc2 = (float)(1.0 / bc2);
        float *m = w + d, *v = w + 2 * (size_t)d;
        for (uint32_t j = 0; j < d; j++) {
            m[j] = b1 * m[j] + c1 * g[j];
            v[j] = b2 * v[j] + c2 * g[j] * g[j];
            w[j] -= a * m[j] / (sqrtf(v[j] * rbc2) + eps);
        }
        break;
    }
    default:
        break;
    }
}

/* Thread pool: an EMB_PULL's rows into its reply. */
static void emb_pull_work(ps_emb *t, ps_wait *x)
{
    char msg[160];
    if (bad_ids(t, x->ids, x->n, msg, sizeof(msg)) != NULL) {
        wait_fail(x, TS_ST_INVALID, msg);
        return;
    }
    if (emb_reserve(t, t->count + emb_new_rows(t, x->ids, x->n)) != 0) {
        wait_fail(x, TS_ST_OUT_OF_MEMORY, "tensord is out of memory growing the table");
        return;
    }
    uint8_t *rec = tsd_item_data(x->reply);
    float *out = (float *)(void *)(rec + ts__rows_rec_head_size(2));
    for (uint64_t i = 0; i < x->n; i++) {
        uint32_t r = emb_row(t, x->ids[i], &x->new_rows);
        memcpy(out + i * t->dim, t->rows + (size_t)r * t->stride, t->dim * sizeof(float));
    }
}

/*
 * Thread pool: an EMB_PUSH. Rows of duplicate ids get one step with the sum of their gradients.
 * Everything is checked and allocated before the first row changes, so a refused push changes
 * nothing.
 */
static void emb_push_work(ps_emb *t, ps_wait *x)
{
    char msg[160];
    uint64_t n = x->n;
    uint32_t d = t->dim;
    if (bad_ids(t, x->ids, n, msg, sizeof(msg)) != NULL) {
        wait_fail(x, TS_ST_INVALID, msg);
        return;
    }
    if (!finite_all(x->grad, n * d)) {
        wait_fail(x, TS_ST_INVALID,
                  "the gradient holds a NaN or an infinity: refused, nothing changed");
        return;
    }
    uint64_t hc = 16;
    while (hc < 2 * n)
        hc *= 2;
    uint32_t *slot_row = ts__malloc((size_t)(hc * sizeof(uint32_t)));
    uint32_t *slot_u = ts__malloc((size_t)(hc * sizeof(uint32_t)));
    uint32_t *urow = ts__malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    float *acc = ts__calloc((size_t)(n ? n : 1), (size_t)d * sizeof(float));
    if (slot_row == NULL || slot_u == NULL || urow == NULL || acc == NULL ||
        emb_reserve(t, t->count + emb_new_rows(t, x->ids, n)) != 0) {
        wait_fail(x, TS_ST_OUT_OF_MEMORY, "tensord is out of memory applying row gradients");
        goto out;
    }
    for (uint64_t i = 0; i < hc; i++)
        slot_row[i] = UINT32_MAX;
    uint32_t nu = 0;
    float s = (float)x->scale;
    for (uint64_t i = 0; i < n; i++) {
        uint32_t r = emb_row(t, x->ids[i], &x->new_rows);
        uint64_t h = mix64(r) & (hc - 1);
        while (slot_row[h] != UINT32_MAX && slot_row[h] != r)
            h = (h + 1) & (hc - 1);
        if (slot_row[h] == UINT32_MAX) {
            slot_row[h] = r;
            slot_u[h] = nu;
            urow[nu++] = r;
        }
        float *a = acc + (size_t)slot_u[h] * d;
        const float *g = x->grad + i * d;
        for (uint32_t j = 0; j < d; j++)
            a[j] += s * g[j];
    }
    for (uint32_t u = 0; u < nu; u++)
        row_step(t, urow[u], acc + (size_t)u * d);
out:
    ts__free(slot_row);
    ts__free(slot_u);
    ts__free(urow);
    ts__free(acc);
}

static void emb_work(uv_work_t *req)
{
    ps_emb *t = req->data;
    for (ps_wait *x = t->job; x != NULL; x = x->next) {
        if (x->op == TS_OP_EMB_PULL)
            emb_pull_work(t, x);
        else
            emb_push_work(t, x);
    }
}

static void emb_kick(tsd_server *srv, ps_emb *t);

static void emb_done(uv_work_t *req, int status)
{
    ps_emb *t = req->data;
    tsd_server *srv = t->srv;
    (void)status;
    t->busy = 0;
    srv->ps->running--;
    /* Charge what the arrays hold now instead of the worst case charged ahead. */
    uint64_t now = emb_bytes(t, 0);
    tsd_store_uncharge(srv, NULL, t->pending);
    t->pending = 0;
    if (now > t->cost)
        (void)tsd_store_charge(srv, NULL, now - t->cost); /* fits: at most what was charged */
    else
        tsd_store_uncharge(srv, NULL, t->cost - now);
    t->cost = now;
    int changed = 0;
    for (ps_wait *x = t->job; x != NULL; x = x->next)
        if (x->op == TS_OP_EMB_PUSH && x->status == TS_ST_OK)
            changed = 1;
    if (changed)
        t->version = tsd_server_next_version(srv);
    ps_wait *x = t->job;
    t->job = NULL;
    while (x != NULL) {
        ps_wait *next = x->next;
        x->version = t->version;
        x->pending = 0;
        wait_answer(srv, x);
        x = next;
    }
    emb_kick(srv, t);
    tsd_server_flush(srv);
    ps_quiet_check(srv);
}

/* 1 when n more bytes fit --max-memory now (nothing is counted or charged). */
static int store_fits(tsd_server *srv, uint64_t n)
{
    if (n == 0 || tsd_store_reserve(&srv->store, n) != 0)
        return n == 0;
    tsd_store_unreserve(&srv->store, n);
    return 1;
}

static void emb_kick(tsd_server *srv, ps_emb *t)
{
    if (t->busy || t->q_head == NULL || ps_paused(srv))
        return;
    /*
     * Charge the growth of the worst case (every id new) ahead; emb_done settles it. When that
     * does not fit, take the waiting requests in order, each with the ids the table lacks (a
     * lookup each, on the loop, only then), while their new rows fit: reading and updating rows
     * that exist never fails for rows that would not be made, and a request whose new rows do
     * not fit fails alone.
     */
    uint64_t n = 0;
    for (ps_wait *x = t->q_head; x != NULL; x = x->next)
        n += x->n;
    uint64_t worst = emb_bytes(t, t->count + n);
    uint64_t ahead = worst > t->cost ? worst - t->cost : 0;
    ps_wait *job = t->q_head;
    if (t->count + n > TSD_PS_MAX_ROWS || !store_fits(srv, ahead)) {
        ps_wait *x = t->q_head, **tail = &job;
        uint64_t rows = 0;
        job = NULL;
        ahead = 0;
        while (x != NULL) {
            ps_wait *next = x->next;
            x->next = NULL;
            uint64_t m = bad_ids(t, x->ids, x->n, NULL, 0) == NULL ? emb_missing(t, x->ids, x->n)
                                                                   : 0; /* fails, makes none */
            uint64_t want = emb_bytes(t, t->count + rows + m);
            uint64_t a = want > t->cost ? want - t->cost : 0;
            if (t->count + rows + m <= TSD_PS_MAX_ROWS && store_fits(srv, a)) {
                rows += m;
                ahead = a;
                *tail = x;
                tail = &x->next;
            } else {
                srv->stats.oom_rejections++;
                wait_fail(x, TS_ST_OUT_OF_MEMORY,
                          "memory limit reached (--max-memory): the table cannot grow by the rows "
                          "asked for");
                wait_answer(srv, x);
            }
            x = next;
        }
        t->q_head = t->q_tail = NULL;
        if (job == NULL)
            return;
    }
    (void)tsd_store_charge(srv, NULL, ahead); /* fits: checked above */
    t->pending = ahead;
    t->job = job;
    t->q_head = t->q_tail = NULL;
    t->busy = 1;
    srv->ps->running++;
    t->work.data = t;
    if (uv_queue_work(srv->loop, &t->work, emb_work, emb_done) != 0) {
        emb_work(&t->work);
        emb_done(&t->work, 0);
    }
}

/* 1 when the two settings create the same table. */
static int same_table(const ps_emb *t, const ts__msg_ps_create_req *q)
{
    return t->dim == q->dim && t->opt == q->optimizer && t->init == q->init && t->seed == q->seed &&
           t->num_ids == q->num_ids && t->lr == q->lr && t->beta1 == q->beta1 &&
           t->beta2 == q->beta2 && t->eps == q->eps && t->init_scale == q->init_scale;
}

static void op_emb_create(tsd_conn *c, const ts__hdr *h, const ts__msg_ps_create_req *q)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    char pn[PS_NAME_CAP];
    tsd_name_printable(q->name, q->name_len, pn, sizeof(pn));
    const char *bad = bad_optimizer(q);
    if (bad == NULL && (q->dim < 1 || q->dim > TSD_PS_MAX_DIM))
        bad = "dim must be 1 to 65536";
    if (bad == NULL && (q->init >= TS_PSW_INIT_COUNT_ || !isfinite(q->init_scale) ||
                        q->init_scale < 0 || q->num_ids > (uint64_t)INT64_MAX))
        bad = "unknown initializer, a negative or non-finite scale, or num_ids past 2^63";
    if (bad != NULL) {
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "EMB_CREATE %s: %s", pn, bad);
        return;
    }
    if (ps_state(srv) == NULL) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    ps_emb *t = emb_find(srv, q->name, q->name_len);
    if (t != NULL) {
        /* Every worker may create the table it uses: the same settings are not a change. */
        if (same_table(t, q))
            tsd_reply_state(c, op, rid, TS_ST_OK, t->version, 0);
        else
            tsd_reply_err(c, op, rid, TS_ST_INVALID,
                          "EMB_CREATE %s: the table exists with other settings", pn);
        return;
    }
    uint64_t need = tsd_heap_block(sizeof(*t) + q->name_len);
    if (tsd_store_charge(srv, NULL, need) != 0) {
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "memory limit reached (--max-memory)");
        return;
    }
    t = ts__calloc(1, sizeof(*t) + q->name_len);
    if (t == NULL) {
        tsd_store_uncharge(srv, NULL, need);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    t->srv = srv;
    node_name_set(&t->node, (uint8_t *)(t + 1), q->name, q->name_len);
    t->dim = q->dim;
    t->opt = q->optimizer;
    t->init = q->init;
    t->seed = q->seed;
    t->num_ids = q->num_ids;
    t->lr = q->lr;
    t->beta1 = q->beta1;
    t->beta2 = q->beta2;
    t->eps = q->eps;
    t->init_scale = q->init_scale;
    uint32_t slots = q->optimizer == TS_PS_OPT_ADAM ? 2 : q->optimizer == TS_PS_OPT_MOMENTUM;
    t->stride = q->dim * (1 + slots);
    t->version = tsd_server_next_version(srv);
    tsd_htab_insert(&srv->ps->embs, &t->node);
    (void)need; /* the struct's charge stays for the table's life (it is never dropped) */
    tsd_reply_state(c, op, rid, TS_ST_OK, t->version, 0);
}

/* An EMB_PULL or EMB_PUSH whose record arrived. */
static void emb_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t nl,
                       const uint8_t *fixed, size_t fixed_len, tsd_item *item)
{
    tsd_server *srv = c->srv;
    uint8_t op = h->opcode;
    uint32_t rid = h->request_id;
    char pn[PS_NAME_CAP];
    tsd_name_printable(name, nl, pn, sizeof(pn));
    ps_emb *t = emb_find(srv, name, nl);
    if (t == NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_NOT_FOUND, "%s: no embedding table %s (EMB_CREATE)",
                      ts__op_name(op), pn);
        return;
    }
    int push = op == TS_OP_EMB_PUSH;
    ps_tensor tt[2];
    int rc = record_tensors(tsd_item_data(item), tsd_item_len(item), tt, push ? 2 : 1);
    const char *bad = NULL;
    if (rc == TS_ENOMEM) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    if (rc != 0 || tt[0].dtype != TS_INT64 || tt[0].ndim != 1)
        bad = push ? "the record is a list of two tensors: ids (int64, [n]) and gradients "
                     "(float32, [n, dim])"
                   : "the record is one int64 tensor of ids, [n]";
    else if (tt[0].numel > TSD_PS_MAX_IDS)
        bad = "more than 2^24 ids in one request";
    else if (push && (tt[1].dtype != TS_FLOAT32 || tt[1].ndim != 2 ||
                      tt[1].shape[0] != tt[0].shape[0] || (uint64_t)tt[1].shape[1] != t->dim))
        bad = "the gradients must be float32 [n, dim] with one row per id";
    double scale = 1.0;
    if (bad == NULL && push) {
        (void)fixed_len;
        scale = ts__msg_emb_push_fixed_decode(fixed);
        if (!isfinite(scale))
            bad = "the scale must be finite";
    }
    if (bad != NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, op, rid, TS_ST_INVALID, "%s %s: %s", ts__op_name(op), pn, bad);
        return;
    }
    uint64_t n = tt[0].numel;
    tsd_item *reply = NULL;
    uint64_t over = 0;
    if (!push) {
        /*
         * The reply is made now and filled by the job: from here it counts against --max-memory
         * as a reply's copy does (orphaned_bytes), its header and the rounding of its buffer as
         * item overhead until it is answered, so pulls queued behind one another cannot together
         * pass the limit. What it takes, rounding included, must fit before it is allocated.
         */
        uint64_t dims[2] = {n, t->dim}, rec_len, data_len, round = 0;
        int fits = ts__rows_rec_size(TS_FLOAT32, 2, dims, &rec_len) == 0 &&
                   ts__rows_tensor_bytes(TS_FLOAT32, 2, dims, &data_len) == 0 &&
                   rec_len <= SIZE_MAX - TSD_POOL_ROUND;
        if (fits) {
            round = rec_len < TSD_POOL_MIN ? 0 : ts__align_up(rec_len, TSD_POOL_ROUND) - rec_len;
            fits = tsd_store_reserve(&srv->store, rec_len + round) == 0;
        }
        if (fits) {
            reply = tsd_item_new((size_t)rec_len);
            tsd_store_unreserve(&srv->store, rec_len + round);
            if (reply == NULL) {
                drop_upload(srv, item);
                srv->stats.out_of_memory++;
                tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
                return;
            }
            reply->orphan_of = &srv->store;
            atomic_fetch_or_explicit(&reply->refs, TSD_ITEM_ORPHANED, memory_order_acq_rel);
            srv->store.orphaned_bytes += rec_len;
            over = tsd_item_overhead(reply);
            fits = tsd_store_charge(srv, NULL, over) == 0;
            if (!fits) {
                tsd_item_unref(reply); /* and its orphaned bytes */
                over = 0;
            }
        } else {
            srv->stats.oom_rejections++;
        }
        if (!fits) {
            drop_upload(srv, item);
            tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY,
                          "memory limit reached (--max-memory): the reply's rows do not fit");
            return;
        }
        ts__rows_rec_head_write(tsd_item_data(reply), TS_FLOAT32, 2, dims, data_len);
    }
    ps_wait *w = wait_new(srv, c, h, item);
    if (w == NULL) {
        drop_upload(srv, item);
        tsd_store_uncharge(srv, NULL, over);
        if (reply != NULL)
            tsd_item_unref(reply);
        tsd_reply_err(c, op, rid, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    w->reply = reply;
    w->reply_over = over;
    w->ids = (const int64_t *)(const void *)tt[0].data;
    w->n = n;
    w->scale = scale;
    if (push)
        w->grad = (const float *)(const void *)tt[1].data;
    queue_push(&t->q_head, &t->q_tail, w);
    emb_kick(srv, t);
}

/* ---------------------------------------------------------------------------------------------
 * Entry points
 */

void tsd_ps_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m)
{
    /* Creating changes what a snapshot holds: refused while they fail, as STREAM_CREATE is. */
    if ((h->opcode == TS_OP_PS_CREATE || h->opcode == TS_OP_EMB_CREATE) &&
        tsd_writes_refused(c->srv)) {
        tsd_refuse_write(c, h->opcode, h->request_id);
        return;
    }
    switch (h->opcode) {
    case TS_OP_PS_CREATE:
        op_ps_create(c, h, &m->u.ps_create);
        return;
    case TS_OP_PS_PULL:
        op_ps_pull(c, h, &m->u.ps_pull);
        return;
    case TS_OP_EMB_CREATE:
        op_emb_create(c, h, &m->u.ps_create);
        return;
    default:
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_UNKNOWN_OPCODE, "not a PS request");
        return;
    }
}

void tsd_ps_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                   const uint8_t *fixed, size_t fixed_len, tsd_item *item)
{
    tsd_server *srv = c->srv;
    srv->stats.ops[h->opcode]++;
    if (ps_state(srv) == NULL) {
        drop_upload(srv, item);
        tsd_reply_err(c, h->opcode, h->request_id, TS_ST_OUT_OF_MEMORY, "tensord is out of memory");
        return;
    }
    if (h->opcode == TS_OP_PS_PUSH)
        ps_push(c, h, name, name_len, fixed, item);
    else
        emb_upload(c, h, name, name_len, fixed, fixed_len, item);
}

void tsd_ps_conn_gone(tsd_server *srv, tsd_conn *c)
{
    if (srv->ps == NULL)
        return;
    for (ps_wait *w = srv->ps->all_head; w != NULL; w = w->anext)
        if (w->c == c)
            w->c = NULL;
}

size_t tsd_ps_conn_stop(tsd_server *srv, tsd_conn *c)
{
    size_t n = 0;
    if (srv->ps == NULL)
        return 0;
    for (ps_wait *w = srv->ps->all_head; w != NULL; w = w->anext) {
        if (w->c != c)
            continue;
        tsd_reply_msg(c, w->op, w->rid, TS_ST_SHUTTING_DOWN, TSD_SHUTDOWN_MSG,
                      sizeof(TSD_SHUTDOWN_MSG) - 1);
        w->c = NULL;
        n++;
    }
    return n;
}

/* Free every parameter and table of ps, the tables of names, and ps. */
static void ps_free_all(tsd_ps *ps)
{
    for (size_t b = 0; b <= ps->params.mask && ps->params.buckets != NULL; b++) {
        while (ps->params.buckets[b] != NULL) {
            ps_param *p = (ps_param *)(void *)ps->params.buckets[b];
            tsd_htab_remove(&ps->params, &p->node);
            param_free_arrays(p);
            ts__free(p);
        }
    }
    for (size_t b = 0; b <= ps->embs.mask && ps->embs.buckets != NULL; b++) {
        while (ps->embs.buckets[b] != NULL) {
            ps_emb *t = (ps_emb *)(void *)ps->embs.buckets[b];
            tsd_htab_remove(&ps->embs, &t->node);
            ts__free(t->keys);
            ts__free(t->idx);
            ts__free(t->rows);
            ts__free(t->steps);
            ts__free(t->load_ids);
            ts__free(t);
        }
    }
    tsd_htab_free(&ps->params);
    tsd_htab_free(&ps->embs);
    ts__free(ps);
}

void tsd_ps_free(tsd_server *srv)
{
    tsd_ps *ps = srv->ps;
    if (ps == NULL)
        return;
    while (ps->all_head != NULL)
        wait_free(srv, ps->all_head);
    srv->ps = NULL;
    /* A snapshot's copies still read the arrays: the last of them frees everything. */
    if (ps->copying > 0) {
        ps->dying = 1;
        return;
    }
    ps_free_all(ps);
}

/* ---------------------------------------------------------------------------------------------
 * Snapshots (ps.h): quiesce, take, copy off the loop, resume
 */

/*
 * Bytes of a parameter's slots or a table's arrays copied on the loop when the snapshot is
 * taken; larger ones are copied on the thread pool (a copy runs at a few hundred MB/s on a busy
 * machine: 64 KiB is well under a millisecond).
 */
#define PS_SNAP_INLINE ((uint64_t)64 << 10)

/* One copy on the thread pool: a parameter's slots or a table's arrays into the snapshot. */
typedef struct ps_copy {
    uv_work_t work;
    tsd_ps_snap *snap;
    ps_param *p; /* one of p and t */
    ps_emb *t;
    size_t index; /* its entry in snap->params or snap->embs */
} ps_copy;

struct tsd_ps_snap {
    tsd_server *srv;
    tsd_ps *ps;    /* the state copied (it outlives srv->ps when tsd_ps_free ran meanwhile) */
    uint32_t refs; /* loop thread: the snapshot job's, and one per copy not back on the loop */
    uv_mutex_t mu;
    uv_cond_t cv;
    uint32_t left; /* copies not done (under mu) */
    int oom;       /* a copy found no memory (under mu) */
    tsd_snapfile_param *params;
    size_t n_params;
    tsd_snapfile_emb *embs;
    size_t n_embs;
    ps_copy *copies;
    size_t n_copies;
    tsd_snapfile_ps out;
};

/* Start the jobs whose requests queued while a snapshot was taken. */
static void ps_resume(tsd_server *srv)
{
    tsd_ps *ps = srv->ps;
    if (ps == NULL || ps_paused(srv))
        return;
    for (size_t b = 0; ps->params.buckets != NULL && b <= ps->params.mask; b++)
        for (tsd_hnode *n = ps->params.buckets[b]; n != NULL; n = n->next)
            param_kick(srv, (ps_param *)(void *)n);
    for (size_t b = 0; ps->embs.buckets != NULL && b <= ps->embs.mask; b++)
        for (tsd_hnode *n = ps->embs.buckets[b]; n != NULL; n = n->next)
            emb_kick(srv, (ps_emb *)(void *)n);
    tsd_server_flush(srv);
}

int tsd_ps_quiesce(tsd_server *srv, void (*cb)(void *arg), void *arg)
{
    tsd_ps *ps = srv->ps;
    if (ps == NULL)
        return 0;
    ps->quiet_req = 1;
    if (ps->running == 0)
        return 0;
    ps->quiet_cb = cb;
    ps->quiet_arg = arg;
    return 1;
}

static void snap_unref(tsd_ps_snap *snap)
{
    if (--snap->refs > 0)
        return;
    for (size_t k = 0; k < snap->n_params; k++) {
        ts__free((void *)snap->params[k].name);
        ts__free((void *)snap->params[k].slot[0]);
        ts__free((void *)snap->params[k].slot[1]);
    }
    for (size_t k = 0; k < snap->n_embs; k++) {
        ts__free((void *)snap->embs[k].name);
        ts__free((void *)snap->embs[k].ids);
        ts__free((void *)snap->embs[k].rows);
        ts__free((void *)snap->embs[k].steps);
    }
    ts__free(snap->params);
    ts__free(snap->embs);
    ts__free(snap->copies);
    uv_cond_destroy(&snap->cv);
    uv_mutex_destroy(&snap->mu);
    ts__free(snap);
}

/* A parameter's slots into out (any thread, while no job runs). 0 or TS_ENOMEM. */
static int copy_param(tsd_snapfile_param *out, const ps_param *p)
{
    size_t bytes = (size_t)p->numel * sizeof(float);
    const float *src[2] = {p->slot1, p->slot2};
    for (uint32_t k = 0; k < tsd_snapfile_slots(p->opt); k++) {
        float *d = ts__malloc(bytes ? bytes : 1);
        if (d == NULL)
            return TS_ENOMEM;
        if (bytes > 0)
            memcpy(d, src[k], bytes);
        out->slot[k] = d;
    }
    return 0;
}

/* The id of each row of t (from its hash) into a new array of t->count. NULL: no memory. */
static int64_t *emb_ids(const ps_emb *t)
{
    int64_t *ids = ts__malloc(t->count ? (size_t)t->count * sizeof(int64_t) : 1);
    if (ids == NULL)
        return NULL;
    for (uint64_t h = 0; h < t->cap; h++)
        if (t->keys[h] >= 0)
            ids[t->idx[h]] = t->keys[h];
    return ids;
}

/* A table's ids, rows and step counts into out (any thread, while no job runs). */
static int copy_emb(tsd_snapfile_emb *out, const ps_emb *t)
{
    size_t n = (size_t)t->count;
    size_t rbytes = n * t->stride * sizeof(float);
    int64_t *ids = emb_ids(t);
    float *rows = ts__malloc(rbytes ? rbytes : 1);
    uint32_t *steps = NULL;
    if (t->opt == TS_PS_OPT_ADAM)
        steps = ts__malloc(n ? n * sizeof(uint32_t) : 1);
    out->ids = ids;
    out->rows = rows;
    out->steps = steps;
    if (ids == NULL || rows == NULL || (t->opt == TS_PS_OPT_ADAM && steps == NULL))
        return TS_ENOMEM; /* what was had is freed with the snapshot */
    if (rbytes > 0)
        memcpy(rows, t->rows, rbytes);
    if (steps != NULL && n > 0)
        memcpy(steps, t->steps, n * sizeof(uint32_t));
    return 0;
}

static void ps_copy_work(uv_work_t *req)
{
    ps_copy *cp = req->data;
    tsd_ps_snap *snap = cp->snap;
    int rc = cp->p != NULL ? copy_param(&snap->params[cp->index], cp->p)
                           : copy_emb(&snap->embs[cp->index], cp->t);
    uv_mutex_lock(&snap->mu);
    if (rc != 0)
        snap->oom = 1;
    if (--snap->left == 0)
        uv_cond_broadcast(&snap->cv);
    uv_mutex_unlock(&snap->mu);
}

/* Loop: a copy is back. After the last one, jobs start again (or the state is freed). */
static void ps_copy_done(uv_work_t *req, int status)
{
    ps_copy *cp = req->data;
    tsd_ps_snap *snap = cp->snap;
    tsd_ps *ps = snap->ps;
    (void)status;
    ps->copying--;
    if (ps->copying == 0 && ps->dying)
        ps_free_all(ps);
    else if (ps->copying == 0)
        ps_resume(snap->srv);
    snap_unref(snap);
}

/* The settings of p into out, with its name and ring in a block of their own. 0 or -1. */
static int take_param(tsd_server *srv, const ps_param *p, tsd_snapfile_param *out)
{
    tsd_bin *bin = tsd_store_find(&srv->store, p->node.name, p->node.name_len);
    uint8_t *blk =
        ts__malloc((size_t)p->node.name_len + (size_t)p->ring_n * TSD_SNAP_RING_SIZE + 1);
    if (blk == NULL)
        return -1;
    if (p->node.name_len > 0)
        memcpy(blk, p->node.name, p->node.name_len);
    uint8_t *ring = blk + p->node.name_len;
    for (uint32_t i = 0; i < p->ring_n; i++) {
        uint32_t j = (p->ring_head + TSD_PS_RING - p->ring_n + i) % TSD_PS_RING;
        ts__put_u64le(ring + (size_t)i * TSD_SNAP_RING_SIZE, p->ring_ver[j]);
        ts__put_u64le(ring + (size_t)i * TSD_SNAP_RING_SIZE + 8, p->ring_step[j]);
    }
    *out = (tsd_snapfile_param){.name = blk,
                                .name_len = p->node.name_len,
                                .opt = p->opt,
                                .mode = p->mode,
                                .flags = p->flags,
                                .k = p->k,
                                .tolerance = p->tolerance,
                                .lr = p->lr,
                                .beta1 = p->beta1,
                                .beta2 = p->beta2,
                                .eps = p->eps,
                                .numel = p->numel,
                                .adam_t = p->adam_t,
                                .steps = p->steps,
                                .bin_version = bin->version,
                                .ring_n = p->ring_n,
                                .ring = ring};
    return 0;
}

static int take_emb(const ps_emb *t, tsd_snapfile_emb *out)
{
    uint8_t *blk = ts__malloc((size_t)t->node.name_len + 1);
    if (blk == NULL)
        return -1;
    if (t->node.name_len > 0)
        memcpy(blk, t->node.name, t->node.name_len);
    *out = (tsd_snapfile_emb){.name = blk,
                              .name_len = t->node.name_len,
                              .dim = t->dim,
                              .opt = t->opt,
                              .init = t->init,
                              .seed = t->seed,
                              .num_ids = t->num_ids,
                              .lr = t->lr,
                              .beta1 = t->beta1,
                              .beta2 = t->beta2,
                              .eps = t->eps,
                              .init_scale = t->init_scale,
                              .version = t->version,
                              .n_rows = t->count};
    return 0;
}

/*
 * A parameter is saved when its bin still holds its value (one float32 tensor of numel): the
 * loader refuses a parameter without one, and the next push would refuse it anyway.
 */
static int param_saveable(tsd_server *srv, ps_param *p)
{
    char msg[200];
    tsd_item *it;
    ps_tensor t;
    return param_value(srv, p->node.name, p->node.name_len, p->numel, &it, &t, msg, sizeof(msg)) ==
           TS_ST_OK;
}

tsd_ps_snap *tsd_ps_snapshot_take(tsd_server *srv, int final, int *rc)
{
    tsd_ps *ps = srv->ps;
    *rc = 0;
    if (ps == NULL)
        return NULL;
    ps->quiet_req = 0;
    ps->quiet_cb = NULL;
    if (ps->params.count == 0 && ps->embs.count == 0) {
        ps_resume(srv);
        return NULL;
    }
    tsd_ps_snap *snap = ts__calloc(1, sizeof(*snap));
    if (snap == NULL || uv_mutex_init(&snap->mu) != 0) {
        ts__free(snap);
        ps_resume(srv);
        *rc = TS_ENOMEM;
        return NULL;
    }
    if (uv_cond_init(&snap->cv) != 0) {
        uv_mutex_destroy(&snap->mu);
        ts__free(snap);
        ps_resume(srv);
        *rc = TS_ENOMEM;
        return NULL;
    }
    snap->srv = srv;
    snap->ps = ps;
    snap->refs = 1;
    size_t np = ps->params.count, ne = ps->embs.count;
    snap->params = ts__calloc(np ? np : 1, sizeof(*snap->params));
    snap->embs = ts__calloc(ne ? ne : 1, sizeof(*snap->embs));
    snap->copies = ts__calloc(np + ne, sizeof(*snap->copies));
    if (snap->params == NULL || snap->embs == NULL || snap->copies == NULL)
        goto oom;
    for (size_t b = 0; ps->params.buckets != NULL && b <= ps->params.mask; b++) {
        for (tsd_hnode *n = ps->params.buckets[b]; n != NULL; n = n->next) {
            ps_param *p = (ps_param *)(void *)n;
            if (!param_saveable(srv, p))
                continue;
            tsd_snapfile_param *out = &snap->params[snap->n_params];
            if (take_param(srv, p, out) != 0)
                goto oom;
            snap->n_params++;
            uint64_t bytes = p->numel * sizeof(float) * tsd_snapfile_slots(p->opt);
            if (final) {
                /* The state is freed right after: the slots change hands instead. */
                out->slot[0] = p->slot1;
                out->slot[1] = p->slot2;
                if (p->opt == TS_PS_OPT_MOMENTUM || p->opt == TS_PS_OPT_ADAM)
                    p->slot1 = NULL;
                if (p->opt == TS_PS_OPT_ADAM)
                    p->slot2 = NULL;
            } else if (bytes <= PS_SNAP_INLINE) {
                if (copy_param(out, p) != 0)
                    goto oom;
            } else {
                snap->copies[snap->n_copies++] =
                    (ps_copy){.snap = snap, .p = p, .index = snap->n_params - 1};
            }
        }
    }
    for (size_t b = 0; ps->embs.buckets != NULL && b <= ps->embs.mask; b++) {
        for (tsd_hnode *n = ps->embs.buckets[b]; n != NULL; n = n->next) {
            ps_emb *t = (ps_emb *)(void *)n;
            tsd_snapfile_emb *out = &snap->embs[snap->n_embs];
            if (take_emb(t, out) != 0)
                goto oom;
            snap->n_embs++;
            uint64_t bytes = t->count * (t->stride * sizeof(float) + sizeof(int64_t));
            if (final) {
                out->ids = emb_ids(t);
                if (out->ids == NULL)
                    goto oom;
                out->rows = t->rows;
                out->steps = t->steps;
                t->rows = NULL;
                t->steps = NULL;
            } else if (bytes <= PS_SNAP_INLINE) {
                if (copy_emb(out, t) != 0)
                    goto oom;
            } else {
                snap->copies[snap->n_copies++] =
                    (ps_copy){.snap = snap, .t = t, .index = snap->n_embs - 1};
            }
        }
    }
    /* Every copy is counted before the first starts, so that none can end the wait early. */
    snap->left = (uint32_t)snap->n_copies;
    for (size_t k = 0; k < snap->n_copies; k++) {
        ps_copy *cp = &snap->copies[k];
        cp->work.data = cp;
        snap->refs++;
        ps->copying++;
        if (uv_queue_work(srv->loop, &cp->work, ps_copy_work, ps_copy_done) != 0) {
            /* Cannot happen with a live loop; copy here rather than lose the state. */
            ps_copy_work(&cp->work);
            ps_copy_done(&cp->work, 0);
        }
    }
    if (snap->n_copies == 0)
        ps_resume(srv);
    return snap;
oom:
    snap_unref(snap);
    ps_resume(srv);
    *rc = TS_ENOMEM;
    return NULL;
}

int tsd_ps_snapshot_wait(tsd_ps_snap *snap, const tsd_snapfile_ps **out)
{
    uv_mutex_lock(&snap->mu);
    while (snap->left > 0)
        uv_cond_wait(&snap->cv, &snap->mu);
    int oom = snap->oom;
    uv_mutex_unlock(&snap->mu);
    snap->out = (tsd_snapfile_ps){.params = snap->params,
                                  .n_params = snap->n_params,
                                  .embs = snap->embs,
                                  .n_embs = snap->n_embs};
    *out = &snap->out;
    return oom ? TS_ENOMEM : 0;
}

void tsd_ps_snapshot_written(tsd_ps_snap *snap)
{
    /*
     * Returning hundreds of megabytes to the system takes tens of milliseconds, which the loop
     * should not spend. Only after tsd_ps_snapshot_wait: no copy writes into the arrays now.
     */
    for (size_t k = 0; k < snap->n_params; k++) {
        ts__free((void *)snap->params[k].slot[0]);
        ts__free((void *)snap->params[k].slot[1]);
        snap->params[k].slot[0] = snap->params[k].slot[1] = NULL;
    }
    for (size_t k = 0; k < snap->n_embs; k++) {
        ts__free((void *)snap->embs[k].ids);
        ts__free((void *)snap->embs[k].rows);
        ts__free((void *)snap->embs[k].steps);
        snap->embs[k].ids = NULL;
        snap->embs[k].rows = NULL;
        snap->embs[k].steps = NULL;
    }
}

void tsd_ps_snapshot_free(tsd_ps_snap *snap)
{
    if (snap != NULL)
        snap_unref(snap);
}

/* ---------------------------------------------------------------------------------------------
 * Loading a snapshot (ps.h), before the loop runs
 */

/*
 * The first steps of loading a parameter (embs 0) or an embedding table (embs 1) named name: the
 * parameter server's state, a check that no other one of its kind has the name, and a zeroed
 * block of size bytes with room for the name after them. The block, or NULL with the message in
 * err.
 */
static void *restore_block(tsd_server *srv, const char *path, int embs, const uint8_t *name,
                           uint8_t name_len, size_t size, char *err, size_t err_cap)
{
    const char *kind = embs ? "embedding table" : "parameter";
    char pn[PS_NAME_CAP];
    tsd_name_printable(name, name_len, pn, sizeof(pn));
    tsd_ps *ps = ps_state(srv);
    if (ps == NULL) {
        snprintf(err, err_cap, "snapshot %s: out of memory loading %s '%s'", path, kind, pn);
        return NULL;
    }
    if (tsd_htab_find(embs ? &ps->embs : &ps->params, name, name_len) != NULL) {
        snprintf(err, err_cap, "snapshot %s is damaged: %s '%s' appears twice", path, kind, pn);
        return NULL;
    }
    void *b = ts__calloc(1, size + name_len);
    if (b == NULL)
        snprintf(err, err_cap, "snapshot %s: out of memory loading %s '%s'", path, kind, pn);
    return b;
}

int tsd_ps_restore_param(tsd_server *srv, const char *path, const tsd_snapfile_param *q, char *err,
                         size_t err_cap)
{
    ps_param *p = restore_block(srv, path, 0, q->name, q->name_len, sizeof(*p), err, err_cap);
    if (p == NULL)
        return -1;
    tsd_ps *ps = srv->ps;
    p->srv = srv;
    node_name_set(&p->node, (uint8_t *)(p + 1), q->name, q->name_len);
    p->opt = q->opt;
    p->mode = q->mode;
    p->flags = q->flags;
    p->k = q->k;
    p->tolerance = q->tolerance;
    p->lr = q->lr;
    p->beta1 = q->beta1;
    p->beta2 = q->beta2;
    p->eps = q->eps;
    p->numel = q->numel;
    p->adam_t = q->adam_t;
    p->steps = q->steps;
    p->load_version = q->bin_version;
    for (uint32_t i = 0; i < q->ring_n; i++) {
        p->ring_ver[i] = ts__get_u64le(q->ring + (size_t)i * TSD_SNAP_RING_SIZE);
        p->ring_step[i] = ts__get_u64le(q->ring + (size_t)i * TSD_SNAP_RING_SIZE + 8);
    }
    p->ring_n = q->ring_n;
    p->ring_head = q->ring_n % TSD_PS_RING;
    tsd_htab_insert(&ps->params, &p->node);
    ps->ld_p = p;
    ps->ld_t = NULL;
    ps->ld_arr = 0;
    return 0;
}

int tsd_ps_restore_emb(tsd_server *srv, const char *path, const tsd_snapfile_emb *q, char *err,
                       size_t err_cap)
{
    ps_emb *t = restore_block(srv, path, 1, q->name, q->name_len, sizeof(*t), err, err_cap);
    if (t == NULL)
        return -1;
    tsd_ps *ps = srv->ps;
    t->srv = srv;
    node_name_set(&t->node, (uint8_t *)(t + 1), q->name, q->name_len);
    t->dim = q->dim;
    t->opt = q->opt;
    t->init = q->init;
    t->seed = q->seed;
    t->num_ids = q->num_ids;
    t->lr = q->lr;
    t->beta1 = q->beta1;
    t->beta2 = q->beta2;
    t->eps = q->eps;
    t->init_scale = q->init_scale;
    t->stride = q->dim * (1 + tsd_snapfile_slots(q->opt));
    t->version = q->version;
    t->count = q->n_rows;
    t->rows_cap = q->n_rows > 0 ? rows_cap_for(q->n_rows) : 0;
    tsd_htab_insert(&ps->embs, &t->node);
    ps->ld_t = t;
    ps->ld_p = NULL;
    ps->ld_arr = 0;
    return 0;
}

void *tsd_ps_restore_array(tsd_server *srv, size_t len)
{
    /* The memory of an empty array (the reader reads nothing into it). */
    static uint64_t empty;
    tsd_ps *ps = srv->ps;
    if (ps == NULL)
        return NULL;
    uint32_t k = ps->ld_arr++;
    if (ps->ld_p != NULL) {
        ps_param *p = ps->ld_p;
        float *a = ts__malloc(len ? len : 1);
        if (k == 0)
            p->slot1 = a;
        else
            p->slot2 = a;
        return a;
    }
    ps_emb *t = ps->ld_t;
    if (t == NULL)
        return NULL;
    if (t->count == 0)
        return &empty;
    if (k == 0)
        return t->load_ids = ts__malloc(len);
    if (k == 1) /* the rows get their capacity now, as emb_reserve would have grown it */
        return t->rows = ts__malloc((size_t)t->rows_cap * t->stride * sizeof(float));
    return t->steps = ts__malloc((size_t)t->rows_cap * sizeof(uint32_t));
}

/* Build t's id hash from the ids loaded; -1 with the message when an id is there twice. */
static int emb_rebuild(ps_emb *t, const char *path, char *err, size_t err_cap)
{
    char pn[PS_NAME_CAP];
    tsd_name_printable(t->node.name, t->node.name_len, pn, sizeof(pn));
    if (t->count == 0)
        return 0;
    uint64_t hc = hash_cap_for(t->count);
    t->keys = ts__malloc((size_t)hc * sizeof(int64_t));
    t->idx = ts__malloc((size_t)hc * sizeof(uint32_t));
    if (t->keys == NULL || t->idx == NULL || t->load_ids == NULL) {
        snprintf(err, err_cap, "snapshot %s: out of memory loading embedding table '%s'", path, pn);
        return -1;
    }
    t->cap = hc;
    for (uint64_t h = 0; h < hc; h++)
        t->keys[h] = -1;
    for (uint64_t r = 0; r < t->count; r++) {
        int64_t id = (int64_t)ts__get_u64le((const uint8_t *)(t->load_ids + r));
        uint64_t h = mix64((uint64_t)id) & (hc - 1);
        while (t->keys[h] >= 0 && t->keys[h] != id)
            h = (h + 1) & (hc - 1);
        if (t->keys[h] == id) {
            snprintf(err, err_cap,
                     "snapshot %s is damaged: embedding table '%s' holds id %lld twice", path, pn,
                     (long long)id);
            return -1;
        }
        t->keys[h] = id;
        t->idx[h] = (uint32_t)r;
    }
    ts__free(t->load_ids);
    t->load_ids = NULL;
    return 0;
}

/* Attach p to its bin: the bin must hold its value at the version its state belongs to. */
static int param_attach(tsd_server *srv, ps_param *p, const char *path, char *err, size_t err_cap)
{
    char pn[PS_NAME_CAP], msg[200];
    tsd_name_printable(p->node.name, p->node.name_len, pn, sizeof(pn));
    tsd_item *it;
    ps_tensor t;
    uint16_t st = param_value(srv, p->node.name, p->node.name_len, 0, &it, &t, msg, sizeof(msg));
    if (st == TS_ST_OK && t.numel != p->numel) {
        snprintf(msg, sizeof(msg), "its bin holds %llu elements, its state is for %llu",
                 (unsigned long long)t.numel, (unsigned long long)p->numel);
        st = TS_ST_INVALID;
    }
    tsd_bin *bin = tsd_store_find(&srv->store, p->node.name, p->node.name_len);
    if (st == TS_ST_OK && bin->version != p->load_version) {
        snprintf(msg, sizeof(msg), "its bin has version %llu, its state belongs to version %llu",
                 (unsigned long long)bin->version, (unsigned long long)p->load_version);
        st = TS_ST_INVALID;
    }
    if (st != TS_ST_OK) {
        snprintf(err, err_cap, "snapshot %s is damaged: parameter '%s': %s", path, pn, msg);
        return -1;
    }
    size_t bytes = (size_t)p->numel * sizeof(float);
    if (p->mode == TS_PS_MODE_SYNC && (p->acc = ts__calloc(1, bytes ? bytes : 1)) == NULL) {
        snprintf(err, err_cap, "snapshot %s: out of memory loading parameter '%s'", path, pn);
        return -1;
    }
    return 0;
}

int tsd_ps_restore_finish(tsd_server *srv, const char *path, size_t *n_params, size_t *n_embs,
                          char *err, size_t err_cap)
{
    tsd_ps *ps = srv->ps;
    *n_params = *n_embs = 0;
    if (ps == NULL)
        return 0;
    ps->ld_p = NULL;
    ps->ld_t = NULL;
    /* Counted whatever --max-memory says, as the bins are (tensord warns when it holds more). */
    uint64_t max_memory = srv->store.max_memory;
    srv->store.max_memory = 0;
    int rc = 0;
    for (size_t b = 0; rc == 0 && ps->embs.buckets != NULL && b <= ps->embs.mask; b++) {
        for (tsd_hnode *n = ps->embs.buckets[b]; rc == 0 && n != NULL; n = n->next) {
            ps_emb *t = (ps_emb *)(void *)n;
            rc = emb_rebuild(t, path, err, err_cap);
            if (rc == 0) {
                t->cost = emb_bytes(t, 0);
                (void)tsd_store_charge(srv, NULL,
                                       t->cost + tsd_heap_block(sizeof(*t) + t->node.name_len));
                (*n_embs)++;
            }
        }
    }
    for (size_t b = 0; rc == 0 && ps->params.buckets != NULL && b <= ps->params.mask; b++) {
        for (tsd_hnode *n = ps->params.buckets[b]; rc == 0 && n != NULL; n = n->next) {
            ps_param *p = (ps_param *)(void *)n;
            rc = param_attach(srv, p, path, err, err_cap);
            if (rc == 0) {
                p->cost = tsd_heap_block(sizeof(*p) + p->node.name_len) +
                          param_arrays(p->opt, p->mode, p->numel);
                (void)tsd_store_charge(srv, NULL, p->cost);
                (*n_params)++;
            }
        }
    }
    srv->store.max_memory = max_memory;
    return rc;
}
