/*
 * The dynamic batching inference manager (include/tensorshare/batcher.h).
 *
 * One mutex guards the whole batcher: the request queue, the deadline heap, the weight updates
 * and the counters. Replica threads hold it only to pick a batch and to record its outcome;
 * models run, rows are copied and callbacks are called without it.
 *
 * A request's life: submit checks it against the schema and queues it (queue + deadline heap);
 * a replica pops it into a batch (it leaves the heap: a request in a forward gets that
 * forward's answer), or the timer thread fails it with TS_ETIMEDOUT at its deadline, or
 * ts_batcher_free cancels it. Exactly one of those three answers it, under the mutex, so the
 * callback runs exactly once.
 */
#include "tensorshare/batcher.h"

#include "proto.h"
#include "record.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#endif

#define TS__BERR_LEN           256   /* bytes; error messages kept per thread and per answer */
#define TS__MAX_REPLICAS       256   /* replicas per batcher; a sanity bound on placement */
#define TS__DEVICE_LEN         32    /* bytes; "cuda:NNN" and room to spare */
#define TS__DEFAULT_MAX_BATCH  64    /* rows */
#define TS__DEFAULT_DELAY_US   500   /* microseconds, Triton's usual order of magnitude */
#define TS__DEFAULT_TIMEOUT_MS 30000 /* milliseconds, the client's request timeout */
#define TS__DEFAULT_MAX_QUEUED 65536 /* requests */

static _Thread_local char tls_err[TS__BERR_LEN];
/* Set on batcher threads, so that a blocking call from a callback fails instead of hanging. */
static _Thread_local int tls_in_batcher;
/*
 * The batcher whose batch's answers this replica thread is handing out, or NULL. A request
 * submitted from one of those callbacks needs no wake-up: the replica looks at the queue as soon
 * as the callbacks are over (see ts_batcher_submit).
 */
static _Thread_local const ts_batcher_t *tls_answering;

static void set_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void set_err(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err, sizeof(tls_err), fmt, ap);
    va_end(ap);
}

const char *ts_batcher_last_error(void)
{
    return tls_err;
}

/* ---------------------------------------------------------------------------------------------
 * Schemas
 */
typedef struct bfield {
    char *name;   /* the dotted name, owned */
    char **parts; /* path components (pointers into path_buf); NULL for a bare tensor */
    char *path_buf;
    int nparts;
    ts_dtype_t dtype;
    int ndim; /* per row */
    int64_t shape[TS_MAX_NDIM];
    size_t row_bytes;
} bfield;

static void fields_free(bfield *f, int n)
{
    if (f == NULL)
        return;
    for (int i = 0; i < n; i++) {
        ts__free(f[i].name);
        ts__free(f[i].parts);
        ts__free(f[i].path_buf);
    }
    ts__free(f);
}

/* Split a dotted name into its components. 0, TS_EINVAL (empty component) or TS_ENOMEM. */
static int field_split(bfield *f)
{
    size_t len = strlen(f->name);
    if (len == 0) {
        f->nparts = 0;
        return 0;
    }
    f->path_buf = ts__strndup(f->name, len);
    int n = 1;
    for (size_t i = 0; i < len; i++)
        n += f->name[i] == '.';
    f->parts = ts__calloc((size_t)n, sizeof(char *));
    if (f->path_buf == NULL || f->parts == NULL)
        return TS_ENOMEM;
    char *p = f->path_buf;
    for (int i = 0; i < n; i++) {
        char *dot = strchr(p, '.');
        if (dot != NULL)
            *dot = '\0';
        if (*p == '\0')
            return TS_EINVAL;
        f->parts[i] = p;
        p = dot != NULL ? dot + 1 : p + strlen(p);
    }
    f->nparts = n;
    return 0;
}

/* 1 when the path of a is a prefix of (or equal to) the path of b. */
static int path_prefix(const bfield *a, const bfield *b)
{
    if (a->nparts > b->nparts)
        return 0;
    for (int i = 0; i < a->nparts; i++)
        if (strcmp(a->parts[i], b->parts[i]) != 0)
            return 0;
    return 1;
}

/* Copy and check a schema. 0, TS_EINVAL (message set) or TS_ENOMEM. */
static int fields_copy(const ts_field_t *in, int n, const char *what, bfield **out)
{
    if (n < 0 || n > TS_BATCHER_MAX_FIELDS || (n > 0 && in == NULL)) {
        set_err("%s schema: 0..%d fields expected", what, TS_BATCHER_MAX_FIELDS);
        return TS_EINVAL;
    }
    bfield *f = ts__calloc((size_t)(n > 0 ? n : 1), sizeof(*f));
    if (f == NULL)
        return TS_ENOMEM;
    int rc = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const ts_field_t *s = &in[i];
        size_t esize = ts_dtype_size(s->dtype);
        if (s->name == NULL || esize == 0 || s->ndim < 0 || s->ndim >= TS_MAX_NDIM) {
            set_err("%s schema: field %d has no name, an unknown dtype or ndim outside 0..%d", what,
                    i, TS_MAX_NDIM - 1);
            rc = TS_EINVAL;
            break;
        }
        f[i].name = ts__strndup(s->name, strlen(s->name));
        if (f[i].name == NULL) {
            rc = TS_ENOMEM;
            break;
        }
        f[i].dtype = s->dtype;
        f[i].ndim = s->ndim;
        size_t rb = esize;
        for (int d = 0; d < s->ndim; d++) {
            f[i].shape[d] = s->shape[d];
            if (s->shape[d] < 0 || __builtin_mul_overflow(rb, (size_t)s->shape[d], &rb)) {
                set_err("%s schema: field '%s' has a bad shape", what, s->name);
                rc = TS_EINVAL;
            }
        }
        f[i].row_bytes = rb;
        if (rc == 0)
            rc = field_split(&f[i]);
        if (rc == TS_EINVAL)
            set_err("%s schema: bad field name '%s'", what, s->name);
    }
    for (int i = 0; i < n && rc == 0; i++) {
        if (f[i].nparts == 0 && n > 1) {
            set_err("%s schema: an unnamed field must be the only one", what);
            rc = TS_EINVAL;
        }
        for (int j = 0; j < n && rc == 0; j++) {
            if (i != j && path_prefix(&f[i], &f[j])) {
                set_err("%s schema: fields '%s' and '%s' overlap", what, f[i].name, f[j].name);
                rc = TS_EINVAL;
            }
        }
    }
    if (rc != 0) {
        fields_free(f, n);
        return rc;
    }
    *out = f;
    return 0;
}

/* The value at a field's path, or NULL. */
static const ts_value_t *field_find(const bfield *f, const ts_value_t *root)
{
    const ts_value_t *v = root;
    for (int i = 0; i < f->nparts && v != NULL; i++)
        v = ts_value_type(v) == TS_TYPE_MAP ? ts_map_get(v, f->parts[i]) : NULL;
    return v;
}

/* Leaves of a tree: every value that is not a map. */
static size_t count_leaves(const ts_value_t *v)
{
    if (ts_value_type(v) != TS_TYPE_MAP)
        return 1;
    size_t n = 0;
    for (size_t i = 0; i < ts_value_len(v); i++)
        n += count_leaves(ts_map_value_at(v, i));
    return n;
}

/*
 * Check a tree against a schema. rows: in, the expected row count (or 0 to learn it, then
 * 1..max_rows); out, the row count. leaves (may be NULL) receives each field's tensor. 0, or
 * TS_ESCHEMA with a message in msg.
 */
static int schema_check(const bfield *f, int n, const ts_value_t *root, int64_t max_rows,
                        int64_t *rows, const ts_tensor_t **leaves, char *msg, size_t msglen)
{
    if (root == NULL) {
        snprintf(msg, msglen, "no value");
        return TS_ESCHEMA;
    }
    int64_t r = *rows;
    for (int i = 0; i < n; i++) {
        const ts_value_t *v = field_find(&f[i], root);
        const ts_tensor_t *t = v != NULL ? ts_value_tensor(v) : NULL;
        if (t == NULL) {
            snprintf(msg, msglen, "field '%s' is missing or not a tensor", f[i].name);
            return TS_ESCHEMA;
        }
        if (t->dtype != f[i].dtype) {
            snprintf(msg, msglen, "field '%s' is %s, expected %s", f[i].name,
                     ts_dtype_name(t->dtype) ? ts_dtype_name(t->dtype) : "?",
                     ts_dtype_name(f[i].dtype));
            return TS_ESCHEMA;
        }
        int ok = t->ndim == f[i].ndim + 1;
        for (int d = 0; ok && d < f[i].ndim; d++)
            ok = t->shape[d + 1] == f[i].shape[d];
        if (!ok) {
            snprintf(msg, msglen,
                     "field '%s' has the wrong shape (ndim %d, expected a batch "
                     "dimension then %d per-row dimensions)",
                     f[i].name, (int)t->ndim, f[i].ndim);
            return TS_ESCHEMA;
        }
        if (r == 0)
            r = t->shape[0];
        if (t->shape[0] != r || r < 1 || r > max_rows) {
            snprintf(msg, msglen, "field '%s' has %lld rows, expected %lld (1..%lld)", f[i].name,
                     (long long)t->shape[0], (long long)r, (long long)max_rows);
            return TS_ESCHEMA;
        }
        if (leaves != NULL)
            leaves[i] = t;
    }
    if (count_leaves(root) != (size_t)n) {
        snprintf(msg, msglen, "the value has entries the schema does not name");
        return TS_ESCHEMA;
    }
    *rows = r;
    return 0;
}

/*
 * Build a tree of freshly allocated tensors for a schema, each with rows rows. leaves receives
 * each field's value (owned by the tree). Returns the root or NULL (ENOMEM).
 */
static ts_value_t *schema_alloc(const bfield *f, int n, int64_t rows, ts_value_t **leaves)
{
    ts_value_t *root = NULL;
    for (int i = 0; i < n; i++) {
        int64_t shape[TS_MAX_NDIM];
        shape[0] = rows;
        for (int d = 0; d < f[i].ndim; d++)
            shape[d + 1] = f[i].shape[d];
        ts_value_t *t = ts_tensor_alloc(f[i].dtype, f[i].ndim + 1, shape);
        if (t == NULL)
            goto fail;
        leaves[i] = t;
        if (f[i].nparts == 0) {
            root = t;
            break;
        }
        if (root == NULL && (root = ts_map_new()) == NULL) {
            ts_value_free(t);
            goto fail;
        }
        ts_value_t *m = root;
        for (int p = 0; p < f[i].nparts - 1; p++) {
            ts_value_t *next = (ts_value_t *)ts_map_get(m, f[i].parts[p]);
            if (next == NULL) {
                if (ts_map_set(m, f[i].parts[p], ts_map_new()) != 0) {
                    ts_value_free(t);
                    goto fail;
                }
                next = (ts_value_t *)ts_map_get(m, f[i].parts[p]);
            }
            m = next;
        }
        if (ts_map_set(m, f[i].parts[f[i].nparts - 1], t) != 0)
            goto fail;
    }
    return root;
fail:
    ts_value_free(root);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Requests, the queue and the deadline heap
 */
typedef struct breq {
    struct breq *prev, *next; /* queue links */
    ts_value_t *owned;        /* a copy of the input (TS_COPY), freed after the callback */
    const ts_value_t *input;
    int64_t rows;
    uint64_t arrival_ns;
    uint64_t deadline_ns; /* 0: none */
    size_t heap_idx;      /* position in the deadline heap, or SIZE_MAX */
    ts_predict_cb cb;
    void *arg;
    const ts_tensor_t *leaf[]; /* one per input field */
} breq;

/* A published weight update. */
typedef struct bweights bweights;
struct bweights {
    const ts_value_t *params;
    int64_t version;
    uint64_t gen;
    ts_weights_release_cb release;
    void *release_arg;
    int users; /* replicas loading it now */
    int done;  /* replicas that loaded it or failed to */
    int first_err;
    char err[TS__BERR_LEN];
    int superseded, withdrawn;
    int released; /* settled: one thread calls (or called) release_weights for it */
    int rel_done; /* release_weights finished the callback; whoever sees it superseded frees */
    struct bwaiter *waiter; /* a blocking ts_batcher_load_weights, or NULL */
};

typedef struct bwaiter {
    pthread_cond_t cv;
    struct bweights *w; /* valid until released */
    int finished;       /* every replica done, or the update was replaced */
    int released;
    int err;
    char msg[TS__BERR_LEN];
} bwaiter;

typedef struct breplica {
    ts_batcher_t *b;
    int index;
    char device[TS__DEVICE_LEN];
    ts_model_t *model;
    pthread_t thread;
    int started;
    uint64_t gen;            /* generation of the last weight update handled */
    int64_t version;         /* weights in the model now */
    ts_value_t *batch;       /* max_batch rows of every input field */
    ts_value_t **batch_leaf; /* per field: the tensor value inside batch */
    breq **picked;           /* the requests of the current batch */
} breplica;

typedef struct bremote bremote;

struct ts_batcher_s {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;    /* idle replicas: a request or weights arrived, or stopping */
    pthread_cond_t collect_cv; /* the gathering replica: more rows arrived */
    pthread_cond_t timer_cv;   /* the timer: the earliest deadline changed */
    bfield *in;
    int n_in;
    bfield *out;
    int n_out;
    int64_t max_batch;
    uint64_t max_delay_ns;
    int timeout_ms;
    size_t max_queued;
    breplica *rep;
    int n_rep;
    breq *head, *tail; /* FIFO queue */
    size_t queued;
    int64_t queued_rows; /* rows of the queued requests */
    breq **heap;         /* min-heap on deadline_ns */
    size_t heap_len, heap_cap;
    int collecting; /* a replica is gathering a batch */
    int stopping;
    pthread_t timer;
    int timer_started;
    uint64_t timer_at; /* the deadline the timer sleeps until; UINT64_MAX: none */
    bweights *wt;      /* the latest update, or NULL */
    uint64_t wt_gen;
    ts_batcher_stats_t st;
    bremote *remote;
};

static uint64_t now_ns(void)
{
    return ts__now_ns();
}

/* Absolute CLOCK_MONOTONIC time for pthread_cond_timedwait (conds are made with it). */
static struct timespec abs_ts(uint64_t ns)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000u);
    ts.tv_nsec = (long)(ns % 1000000000u);
    return ts;
}

static int cond_init(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a) != 0)
        return TS_ENOMEM;
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc == 0 ? 0 : TS_ENOMEM;
}

static void heap_swap(ts_batcher_t *b, size_t i, size_t j)
{
    breq *t = b->heap[i];
    b->heap[i] = b->heap[j];
    b->heap[j] = t;
    b->heap[i]->heap_idx = i;
    b->heap[j]->heap_idx = j;
}

static void heap_up(ts_batcher_t *b, size_t i)
{
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (b->heap[p]->deadline_ns <= b->heap[i]->deadline_ns)
            break;
        heap_swap(b, i, p);
        i = p;
    }
}

static void heap_down(ts_batcher_t *b, size_t i)
{
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < b->heap_len && b->heap[l]->deadline_ns < b->heap[m]->deadline_ns)
            m = l;
        if (r < b->heap_len && b->heap[r]->deadline_ns < b->heap[m]->deadline_ns)
            m = r;
        if (m == i)
            return;
        heap_swap(b, i, m);
        i = m;
    }
}

/* Add a request with a deadline. 0 or TS_ENOMEM. Lock held. */
static int heap_push(ts_batcher_t *b, breq *r)
{
    if (b->heap_len == b->heap_cap) {
        size_t cap = b->heap_cap ? b->heap_cap * 2 : 64;
        breq **h = ts__realloc(b->heap, cap * sizeof(*h));
        if (h == NULL)
            return TS_ENOMEM;
        b->heap = h;
        b->heap_cap = cap;
    }
    r->heap_idx = b->heap_len;
    b->heap[b->heap_len++] = r;
    heap_up(b, r->heap_idx);
    return 0;
}

/* Remove a request from the heap if it is there. Lock held. */
static void heap_remove(ts_batcher_t *b, breq *r)
{
    size_t i = r->heap_idx;
    if (i == SIZE_MAX)
        return;
    r->heap_idx = SIZE_MAX;
    b->heap_len--;
    if (i == b->heap_len)
        return;
    b->heap[i] = b->heap[b->heap_len];
    b->heap[i]->heap_idx = i;
    heap_up(b, i);
    heap_down(b, b->heap[i]->heap_idx);
}

/*
 * Remove n requests from the heap at once (those not in it are skipped). A batch usually takes
 * the oldest requests, which are at the top of the heap when every request has the same
 * timeout, and removing them one by one would sift each time; when that costs more than
 * rebuilding the heap from what remains (about n log2 heap_len against heap_len steps), the
 * heap is compacted and rebuilt instead. Lock held.
 */
static void heap_remove_many(ts_batcher_t *b, breq **rs, int n)
{
    size_t in_heap = 0;
    for (int i = 0; i < n; i++)
        in_heap += rs[i]->heap_idx != SIZE_MAX;
    if (in_heap == 0)
        return;
    size_t depth = (size_t)(64 - __builtin_clzll((unsigned long long)b->heap_len));
    if (in_heap * depth < b->heap_len) {
        for (int i = 0; i < n; i++)
            heap_remove(b, rs[i]);
        return;
    }
    for (int i = 0; i < n; i++) {
        if (rs[i]->heap_idx != SIZE_MAX) {
            b->heap[rs[i]->heap_idx] = NULL;
            rs[i]->heap_idx = SIZE_MAX;
        }
    }
    size_t len = 0;
    for (size_t i = 0; i < b->heap_len; i++) {
        if (b->heap[i] != NULL) {
            b->heap[len] = b->heap[i];
            b->heap[len]->heap_idx = len;
            len++;
        }
    }
    b->heap_len = len;
    for (size_t i = len / 2; i-- > 0;)
        heap_down(b, i);
}

/* Unlink a request from the queue, leaving the heap alone. Lock held. */
static void unlink_queued(ts_batcher_t *b, breq *r)
{
    if (r->prev != NULL)
        r->prev->next = r->next;
    else
        b->head = r->next;
    if (r->next != NULL)
        r->next->prev = r->prev;
    else
        b->tail = r->prev;
    r->prev = r->next = NULL;
    b->queued--;
    b->queued_rows -= r->rows;
}

/* Unlink a request from the queue and the heap. Lock held. */
static void unqueue(ts_batcher_t *b, breq *r)
{
    unlink_queued(b, r);
    heap_remove(b, r);
}

static void req_free(breq *r)
{
    ts_value_free(r->owned);
    ts__free(r);
}

/* Answer a request that no thread references any more (called without the lock). */
static void answer(ts_batcher_t *b, breq *r, int status, ts_value_t *output, int64_t version,
                   const char *msg)
{
    r->cb(b, status, output, version, status != 0 ? msg : NULL, r->arg);
    req_free(r);
}

/* ---------------------------------------------------------------------------------------------
 * Weight updates
 */

/*
 * Decide whether an update can be released (no replica reads it and none will). Returns 1 when
 * the caller must call release_weights after unlocking. Lock held.
 */
static int weights_settle(ts_batcher_t *b, bweights *w)
{
    if (w->done == b->n_rep && w->waiter != NULL && !w->waiter->finished) {
        w->waiter->finished = 1;
        w->waiter->err = w->first_err;
        memcpy(w->waiter->msg, w->err, sizeof(w->err));
        pthread_cond_broadcast(&w->waiter->cv);
    }
    if (w->released || w->users > 0)
        return 0;
    if (w->done < b->n_rep && !w->superseded && !w->withdrawn && !b->stopping)
        return 0;
    w->released = 1;
    if (w->waiter != NULL) {
        w->waiter->finished = 1;
        if (w->done == b->n_rep)
            w->waiter->err = w->first_err;
        w->waiter->released = 1;
        pthread_cond_broadcast(&w->waiter->cv);
        w->waiter = NULL;
    }
    return 1;
}

/*
 * Call the release callback, and free the update unless it is still the latest. No lock.
 * A publish may replace w while the callback runs: it frees w only once rel_done is set, and
 * rel_done is set under the lock together with the check here, so exactly one of the two
 * frees it.
 */
static void release_weights(ts_batcher_t *b, bweights *w)
{
    if (w->release != NULL)
        w->release(w->params, w->release_arg);
    pthread_mutex_lock(&b->mu);
    w->rel_done = 1;
    int keep = b->wt == w;
    pthread_mutex_unlock(&b->mu);
    if (!keep)
        ts__free(w);
}

/* Load the latest update into a replica if it has not seen it. Lock held (dropped meanwhile). */
static void replica_update(breplica *r)
{
    ts_batcher_t *b = r->b;
    bweights *w = b->wt;
    if (w == NULL || w->gen <= r->gen)
        return;
    r->gen = w->gen;
    if (w->withdrawn)
        return;
    w->users++;
    pthread_mutex_unlock(&b->mu);
    char err[TS__BERR_LEN] = "";
    int rc = r->model->ops->load_weights != NULL
                 ? r->model->ops->load_weights(r->model, w->params, err, sizeof(err))
                 : TS_ENOTSUP;
    pthread_mutex_lock(&b->mu);
    w->users--;
    w->done++;
    if (rc == 0) {
        r->version = w->version;
        b->st.weight_loads++;
    } else if (w->first_err == 0) {
        w->first_err = rc;
        snprintf(w->err, sizeof(w->err), "replica %d (%s): %.200s", r->index, r->device,
                 err[0] ? err : ts_strerror(rc));
    }
    if (weights_settle(b, w)) {
        pthread_mutex_unlock(&b->mu);
        release_weights(b, w);
        pthread_mutex_lock(&b->mu);
    }
}

/* Publish an update (with an optional blocking waiter attached). 0, TS_ENOMEM, TS_ECANCELED. */
static int publish(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                   ts_weights_release_cb release, void *arg, bwaiter *waiter)
{
    bweights *w = ts__calloc(1, sizeof(*w));
    if (w == NULL)
        return TS_ENOMEM;
    w->params = params;
    w->version = version;
    w->release = release;
    w->release_arg = arg;
    w->waiter = waiter;
    pthread_mutex_lock(&b->mu);
    if (b->stopping) {
        pthread_mutex_unlock(&b->mu);
        ts__free(w);
        set_err("the batcher is shutting down");
        return TS_ECANCELED;
    }
    if (waiter != NULL)
        waiter->w = w;
    w->gen = ++b->wt_gen;
    bweights *old = b->wt;
    b->wt = w;
    int rel_old = 0, free_old = 0;
    if (old != NULL) {
        old->superseded = 1;
        /* Released and its callback over: nobody else touches it. Released with the callback
           still running: release_weights frees it, seeing it is no longer the latest. */
        free_old = old->released && old->rel_done;
        rel_old = weights_settle(b, old);
    }
    pthread_cond_broadcast(&b->work_cv);
    pthread_mutex_unlock(&b->mu);
    if (rel_old)
        release_weights(b, old);
    else if (free_old)
        ts__free(old);
    return 0;
}

int ts_batcher_set_weights(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                           ts_weights_release_cb release, void *arg)
{
    if (b == NULL || params == NULL)
        return TS_EINVAL;
    return publish(b, params, version, release, arg, NULL);
}

int ts_batcher_load_weights(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                            int timeout_ms)
{
    if (b == NULL || params == NULL)
        return TS_EINVAL;
    if (tls_in_batcher) {
        set_err("ts_batcher_load_weights called from a batcher callback");
        return TS_EDEADLK;
    }
    bwaiter wt;
    memset(&wt, 0, sizeof(wt));
    if (cond_init(&wt.cv) != 0)
        return TS_ENOMEM;
    int rc = publish(b, params, version, NULL, NULL, &wt);
    if (rc != 0) {
        pthread_cond_destroy(&wt.cv);
        return rc;
    }
    uint64_t deadline = timeout_ms >= 0 ? now_ns() + (uint64_t)timeout_ms * 1000000u : 0;
    pthread_mutex_lock(&b->mu);
    int timed_out = 0;
    while (!wt.finished) {
        if (deadline == 0) {
            pthread_cond_wait(&wt.cv, &b->mu);
        } else {
            struct timespec ts = abs_ts(deadline);
            if (pthread_cond_timedwait(&wt.cv, &b->mu, &ts) == ETIMEDOUT && !wt.finished) {
                timed_out = 1;
                break;
            }
        }
    }
    if (timed_out && !wt.released) {
        /* Withdraw: replicas that have not started loading it skip it from now on. */
        bweights *w = wt.w;
        w->withdrawn = 1;
        if (weights_settle(b, w)) {
            pthread_mutex_unlock(&b->mu);
            release_weights(b, w);
            pthread_mutex_lock(&b->mu);
        }
    }
    /* params is borrowed for this call only: wait until no replica reads it. */
    while (!wt.released)
        pthread_cond_wait(&wt.cv, &b->mu);
    pthread_mutex_unlock(&b->mu);
    pthread_cond_destroy(&wt.cv);
    if (timed_out) {
        set_err("weight update not loaded by every replica within %d ms", timeout_ms);
        return TS_ETIMEDOUT;
    }
    if (wt.err != 0)
        set_err("%s", wt.msg);
    return wt.err;
}

void ts_batcher_versions(ts_batcher_t *b, int64_t *min_version, int64_t *max_version)
{
    pthread_mutex_lock(&b->mu);
    int64_t lo = b->rep[0].version, hi = lo;
    for (int i = 1; i < b->n_rep; i++) {
        if (b->rep[i].version < lo)
            lo = b->rep[i].version;
        if (b->rep[i].version > hi)
            hi = b->rep[i].version;
    }
    pthread_mutex_unlock(&b->mu);
    if (min_version != NULL)
        *min_version = lo;
    if (max_version != NULL)
        *max_version = hi;
}

/* ---------------------------------------------------------------------------------------------
 * Outputs: each requester gets views of its rows of the batch output, sharing it.
 */
typedef struct bshared {
    atomic_int refs;
    ts_value_t *tree;
} bshared;

static void shared_unref(void *p)
{
    bshared *s = p;
    if (atomic_fetch_sub(&s->refs, 1) == 1) {
        ts_value_free(s->tree);
        ts__free(s);
    }
}

/* Check a model output: schema fields, or (no schema) every tensor has rows rows. */
static int output_check(const ts_batcher_t *b, const ts_value_t *v, int64_t rows, char *msg,
                        size_t msglen)
{
    if (b->n_out > 0) {
        int64_t r = rows;
        return schema_check(b->out, b->n_out, v, rows, &r, NULL, msg, msglen);
    }
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST:
        for (size_t i = 0; i < ts_value_len(v); i++) {
            const ts_value_t *c =
                ts_value_type(v) == TS_TYPE_MAP ? ts_map_value_at(v, i) : ts_list_at(v, i);
            int rc = output_check(b, c, rows, msg, msglen);
            if (rc != 0)
                return rc;
        }
        return 0;
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        if (t->ndim < 1 || t->shape[0] != rows) {
            snprintf(msg, msglen, "an output tensor lacks the batch dimension of %lld rows",
                     (long long)rows);
            return TS_ESCHEMA;
        }
        return 0;
    }
    default:
        return 0;
    }
}

/* Rows [off, off+rows) of v as a new tree of views holding a reference on s. NULL on ENOMEM. */
static ts_value_t *slice(const ts_value_t *v, int64_t off, int64_t rows, bshared *s)
{
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int map = ts_value_type(v) == TS_TYPE_MAP;
        ts_value_t *c = map ? ts_map_new() : ts_list_new();
        if (c == NULL)
            return NULL;
        for (size_t i = 0; i < ts_value_len(v); i++) {
            ts_value_t *child = slice(map ? ts_map_value_at(v, i) : ts_list_at(v, i), off, rows, s);
            int rc = map ? ts_map_set(c, ts_map_key_at(v, i), child) : ts_list_push(c, child);
            if (rc != 0) {
                ts_value_free(c);
                return NULL;
            }
        }
        return c;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        int64_t shape[TS_MAX_NDIM];
        memcpy(shape, t->shape, sizeof(shape));
        shape[0] = rows;
        size_t row_bytes = t->shape[0] > 0 ? ts_tensor_nbytes(t) / (size_t)t->shape[0] : 0;
        const uint8_t *data = t->data;
        if (data != NULL && row_bytes > 0)
            data += (size_t)off * row_bytes;
        else
            data = NULL;
        ts_value_t *c = ts_tensor_new(t->dtype, t->ndim, shape, data, TS_BORROW);
        if (c != NULL) {
            atomic_fetch_add(&s->refs, 1);
            c->release = shared_unref;
            c->owner = s;
        }
        return c;
    }
    default:
        return ts_value_clone(v);
    }
}

/* ---------------------------------------------------------------------------------------------
 * Replicas
 */

/*
 * Rows that the queue's head and the requests after it, in order, bring to a batch.
 * *more is set when the next request does not fit (the batch cannot grow). Lock held.
 */
static int64_t fit_rows(const ts_batcher_t *b, int *more_blocked)
{
    int64_t rows = 0;
    *more_blocked = 0;
    for (const breq *r = b->head; r != NULL; r = r->next) {
        if (rows + r->rows > b->max_batch) {
            *more_blocked = 1;
            break;
        }
        rows += r->rows;
    }
    return rows;
}

/*
 * Gather one batch into r->picked following the batching rule. Returns the number of requests
 * picked (0 when stopping or the queue emptied). Lock held; may wait on collect_cv.
 */
static int gather(breplica *r)
{
    ts_batcher_t *b = r->b;
    for (;;) {
        if (b->stopping || b->head == NULL)
            return 0;
        int blocked;
        int64_t rows = fit_rows(b, &blocked);
        if (blocked || rows >= b->max_batch)
            break;
        uint64_t flush_at = b->head->arrival_ns + b->max_delay_ns;
        if (now_ns() >= flush_at)
            break;
        struct timespec ts = abs_ts(flush_at);
        pthread_cond_timedwait(&b->collect_cv, &b->mu, &ts);
    }
    int n = 0;
    int64_t rows = 0;
    while (b->head != NULL && rows + b->head->rows <= b->max_batch) {
        breq *q = b->head;
        rows += q->rows;
        unlink_queued(b, q);
        r->picked[n++] = q;
    }
    heap_remove_many(b, r->picked, n);
    return n;
}

/* Run one batch and answer its requests. No lock held. */
static void run_batch(breplica *r, int n, int64_t version)
{
    ts_batcher_t *b = r->b;
    char msg[TS__BERR_LEN] = "";
    int64_t rows = 0;
    for (int i = 0; i < n; i++)
        rows += r->picked[i]->rows;
    const ts_value_t *input;
    if (n == 1) {
        /* A lone request is its own batch: no copy. */
        input = r->picked[0]->input;
    } else {
        int64_t off = 0;
        for (int i = 0; i < n; i++) {
            const breq *q = r->picked[i];
            for (int f = 0; f < b->n_in; f++) {
                size_t rb = b->in[f].row_bytes;
                if (rb > 0)
                    memcpy((uint8_t *)r->batch_leaf[f]->u.tensor.data + (size_t)off * rb,
                           q->leaf[f]->data, (size_t)q->rows * rb);
            }
            off += q->rows;
        }
        for (int f = 0; f < b->n_in; f++)
            r->batch_leaf[f]->u.tensor.shape[0] = rows;
        input = r->batch;
    }
    ts_value_t *out = NULL;
    char err[TS__BERR_LEN] = "";
    int rc = r->model->ops->forward(r->model, input, rows, &out, err, sizeof(err));
    if (rc != 0) {
        snprintf(msg, sizeof(msg), "model failed on %s: %.200s", r->device,
                 err[0] ? err : ts_strerror(rc));
        ts_value_free(out);
        out = NULL;
        rc = TS_EMODEL;
    } else if (out == NULL) {
        snprintf(msg, sizeof(msg), "model on %s returned no output", r->device);
        rc = TS_EMODEL;
    } else {
        char why[TS__BERR_LEN - 64];
        if (output_check(b, out, rows, why, sizeof(why)) != 0) {
            snprintf(msg, sizeof(msg), "model output does not match the schema: %s", why);
            ts_value_free(out);
            out = NULL;
            rc = TS_EMODEL;
        }
    }
    pthread_mutex_lock(&b->mu);
    b->st.batches++;
    b->st.rows += (uint64_t)rows;
    if (rows == b->max_batch)
        b->st.full_batches++;
    if (rc == 0)
        b->st.requests += (uint64_t)n;
    else
        b->st.failed += (uint64_t)n;
    pthread_mutex_unlock(&b->mu);

    if (rc != 0) {
        for (int i = 0; i < n; i++)
            answer(b, r->picked[i], rc, NULL, version, msg);
        return;
    }
    if (n == 1) {
        answer(b, r->picked[0], 0, out, version, NULL);
        return;
    }
    bshared *s = ts__malloc(sizeof(*s));
    if (s == NULL) {
        ts_value_free(out);
        for (int i = 0; i < n; i++)
            answer(b, r->picked[i], TS_ENOMEM, NULL, version, "out of memory");
        return;
    }
    atomic_init(&s->refs, 1);
    s->tree = out;
    int64_t off = 0;
    for (int i = 0; i < n; i++) {
        breq *q = r->picked[i];
        ts_value_t *mine = slice(out, off, q->rows, s);
        off += q->rows;
        if (mine == NULL)
            answer(b, q, TS_ENOMEM, NULL, version, "out of memory");
        else
            answer(b, q, 0, mine, version, NULL);
    }
    shared_unref(s);
}

#ifdef __linux__
/* Answers of blocking predicts collected by a replica thread; see sync_post. */
typedef struct bchain {
    struct bsync *head, *tail;
} bchain;

static _Thread_local bchain *tls_chain;
static void chain_flush(bchain *c);
#endif

static void *replica_main(void *arg)
{
    breplica *r = arg;
    ts_batcher_t *b = r->b;
    tls_in_batcher = 1;
    pthread_mutex_lock(&b->mu);
    for (;;) {
        replica_update(r);
        if (b->stopping)
            break;
        if (b->wt != NULL && b->wt->gen > r->gen)
            continue; /* a newer update came while loading */
        if (b->head == NULL || b->collecting) {
            pthread_cond_wait(&b->work_cv, &b->mu);
            continue;
        }
        b->collecting = 1;
        int n = gather(r);
        b->collecting = 0;
        /* Another idle replica may gather the next batch while this one runs. */
        if (b->head != NULL)
            pthread_cond_signal(&b->work_cv);
        if (n == 0)
            continue;
        int64_t version = r->version;
        pthread_mutex_unlock(&b->mu);
#ifdef __linux__
        bchain chain = {NULL, NULL};
        tls_chain = &chain;
        tls_answering = b;
        run_batch(r, n, version);
        tls_answering = NULL;
        tls_chain = NULL;
        chain_flush(&chain);
#else
        tls_answering = b;
        run_batch(r, n, version);
        tls_answering = NULL;
#endif
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* The timer thread: fails queued requests at their deadline. */
static void *timer_main(void *arg)
{
    ts_batcher_t *b = arg;
    tls_in_batcher = 1;
    pthread_mutex_lock(&b->mu);
    while (!b->stopping) {
        if (b->heap_len == 0) {
            b->timer_at = UINT64_MAX;
            pthread_cond_wait(&b->timer_cv, &b->mu);
            continue;
        }
        breq *r = b->heap[0];
        if (r->deadline_ns > now_ns()) {
            /* A request taken from the heap leaves this wait early at worst, never late. */
            b->timer_at = r->deadline_ns;
            struct timespec ts = abs_ts(r->deadline_ns);
            pthread_cond_timedwait(&b->timer_cv, &b->mu, &ts);
            continue;
        }
        unqueue(b, r);
        b->st.failed++;
        if (b->collecting)
            pthread_cond_signal(&b->collect_cv);
        pthread_mutex_unlock(&b->mu);
        answer(b, r, TS_ETIMEDOUT, NULL, 0, "deadline passed while the request was queued");
        pthread_mutex_lock(&b->mu);
    }
    pthread_mutex_unlock(&b->mu);
    return NULL;
}

/* ---------------------------------------------------------------------------------------------
 * Creation and shutdown
 */
void ts_batcher_config_init(ts_batcher_config_t *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->max_batch = TS__DEFAULT_MAX_BATCH;
    cfg->max_delay_us = TS__DEFAULT_DELAY_US;
    cfg->placement = "cpu";
    cfg->timeout_ms = TS__DEFAULT_TIMEOUT_MS;
    cfg->max_queued = TS__DEFAULT_MAX_QUEUED;
}

/* Parse a non-negative decimal number at *p (advancing it). 0 or -1. */
static int parse_num(const char **p, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(*p, &end, 10);
    if (end == *p || errno != 0 || v < 0 || v > 1000000)
        return -1;
    *p = end;
    *out = v;
    return 0;
}

/* Append a device. 0, or -1 when there are too many. */
static int add_dev(char (*devs)[TS__DEVICE_LEN], int *n, const char *kind, long index)
{
    if (*n >= TS__MAX_REPLICAS)
        return -1;
    if (index < 0)
        snprintf(devs[*n], TS__DEVICE_LEN, "%s", kind);
    else
        snprintf(devs[*n], TS__DEVICE_LEN, "%s:%ld", kind, index);
    (*n)++;
    return 0;
}

/* Expand a placement into one device per replica. 0, TS_EINVAL or TS_ENOTSUP (message set). */
static int parse_placement(const char *spec, int cuda_devices, char (*devs)[TS__DEVICE_LEN], int *n)
{
    *n = 0;
    const char *p = spec != NULL && *spec ? spec : "cpu";
    while (*p) {
        long a = -1, k = 1;
        int bad = 0;
        if (strncmp(p, "cpu", 3) == 0) {
            p += 3;
            if (*p == ':')
                p++, bad = parse_num(&p, &k) != 0 || k < 1;
            for (long i = 0; !bad && i < k; i++)
                bad = add_dev(devs, n, "cpu", -1) != 0;
        } else if (strncmp(p, "cuda", 4) == 0) {
            p += 4;
            int all = 1, rr = 0;
            if (*p == ':') {
                p++;
                all = 0;
                bad = parse_num(&p, &a) != 0;
            }
            if (!bad && *p == '*')
                p++, bad = parse_num(&p, &k) != 0 || k < 1;
            else if (!bad && *p == '/' && all)
                p++, rr = 1, bad = parse_num(&p, &k) != 0 || k < 1;
            if (!bad && all && cuda_devices <= 0) {
                set_err("placement '%s': no CUDA device available", spec);
                return TS_ENOTSUP;
            }
            if (!bad && !all && cuda_devices > 0 && a >= cuda_devices) {
                set_err("placement '%s': cuda:%ld does not exist (%d devices)", spec, a,
                        cuda_devices);
                return TS_EINVAL;
            }
            if (!bad && rr) {
                for (long i = 0; !bad && i < k; i++)
                    bad = add_dev(devs, n, "cuda", i % cuda_devices) != 0;
            } else if (!bad && all) {
                for (long d = 0; !bad && d < cuda_devices; d++)
                    for (long i = 0; !bad && i < k; i++)
                        bad = add_dev(devs, n, "cuda", d) != 0;
            } else {
                for (long i = 0; !bad && i < k; i++)
                    bad = add_dev(devs, n, "cuda", a) != 0;
            }
        } else {
            bad = 1;
        }
        if (!bad && *p == ',' && p[1] != '\0')
            p++;
        else if (!bad && *p != '\0')
            bad = 1;
        if (bad) {
            set_err("placement '%s': expected cpu[:N], cuda:I[*K], cuda[*K] or cuda/N, comma-"
                    "separated, at most %d replicas",
                    spec, TS__MAX_REPLICAS);
            return TS_EINVAL;
        }
    }
    return 0;
}

static void stop_threads(ts_batcher_t *b)
{
    pthread_mutex_lock(&b->mu);
    b->stopping = 1;
    pthread_cond_broadcast(&b->work_cv);
    pthread_cond_broadcast(&b->collect_cv);
    pthread_cond_broadcast(&b->timer_cv);
    pthread_mutex_unlock(&b->mu);
    for (int i = 0; i < b->n_rep; i++)
        if (b->rep[i].started)
            pthread_join(b->rep[i].thread, NULL);
    if (b->timer_started)
        pthread_join(b->timer, NULL);
}

static void destroy(ts_batcher_t *b)
{
    /* Cancel what is still queued; every thread is gone, so no lock is needed. */
    while (b->head != NULL) {
        breq *r = b->head;
        unqueue(b, r);
        b->st.failed++;
        answer(b, r, TS_ECANCELED, NULL, 0, "the batcher is shutting down");
    }
    bweights *w = b->wt;
    if (w != NULL) {
        int rel = weights_settle(b, w);
        b->wt = NULL;
        if (rel)
            release_weights(b, w); /* frees it: no longer the latest */
        else
            ts__free(w);
    }
    for (int i = 0; i < b->n_rep; i++) {
        breplica *r = &b->rep[i];
        if (r->model != NULL && r->model->ops->free != NULL)
            r->model->ops->free(r->model);
        ts_value_free(r->batch);
        ts__free(r->batch_leaf);
        ts__free(r->picked);
    }
    ts__free(b->rep);
    ts__free(b->heap);
    fields_free(b->in, b->n_in);
    fields_free(b->out, b->n_out);
    pthread_cond_destroy(&b->work_cv);
    pthread_cond_destroy(&b->collect_cv);
    pthread_cond_destroy(&b->timer_cv);
    pthread_mutex_destroy(&b->mu);
    ts__free(b);
}

int ts_batcher_new(ts_batcher_t **out, const ts_batcher_config_t *cfg)
{
    tls_err[0] = '\0';
    if (out == NULL || cfg == NULL || cfg->create == NULL || cfg->max_batch < 1 ||
        cfg->max_delay_us < 0 || cfg->n_inputs < 1) {
        set_err("configuration needs a model factory, an input schema and max_batch >= 1");
        return TS_EINVAL;
    }
    char(*devs)[TS__DEVICE_LEN] = ts__calloc(TS__MAX_REPLICAS, TS__DEVICE_LEN);
    if (devs == NULL)
        return TS_ENOMEM;
    int n_rep = 0;
    int rc = parse_placement(cfg->placement, cfg->cuda_devices, devs, &n_rep);
    if (rc != 0) {
        ts__free(devs);
        return rc;
    }
    ts_batcher_t *b = ts__calloc(1, sizeof(*b));
    if (b == NULL) {
        ts__free(devs);
        return TS_ENOMEM;
    }
    pthread_mutex_init(&b->mu, NULL);
    cond_init(&b->work_cv);
    cond_init(&b->collect_cv);
    cond_init(&b->timer_cv);
    b->timer_at = UINT64_MAX;
    b->max_batch = cfg->max_batch;
    b->max_delay_ns = (uint64_t)cfg->max_delay_us * 1000u;
    b->timeout_ms = cfg->timeout_ms;
    b->max_queued = cfg->max_queued > 0 ? cfg->max_queued : TS__DEFAULT_MAX_QUEUED;
    b->st.max_batch = (uint32_t)cfg->max_batch;
    rc = fields_copy(cfg->inputs, cfg->n_inputs, "input", &b->in);
    if (rc == 0) {
        b->n_in = cfg->n_inputs;
        rc = fields_copy(cfg->outputs, cfg->n_outputs, "output", &b->out);
    }
    if (rc == 0) {
        b->n_out = cfg->n_outputs;
        b->rep = ts__calloc((size_t)n_rep, sizeof(*b->rep));
        rc = b->rep != NULL ? 0 : TS_ENOMEM;
    }
    for (int i = 0; rc == 0 && i < n_rep; i++) {
        breplica *r = &b->rep[i];
        b->n_rep = i + 1;
        r->b = b;
        r->index = i;
        r->version = cfg->version;
        memcpy(r->device, devs[i], TS__DEVICE_LEN);
        r->batch_leaf = ts__calloc((size_t)b->n_in, sizeof(*r->batch_leaf));
        r->picked = ts__calloc((size_t)b->max_batch, sizeof(*r->picked));
        if (r->batch_leaf == NULL || r->picked == NULL ||
            (r->batch = schema_alloc(b->in, b->n_in, b->max_batch, r->batch_leaf)) == NULL) {
            rc = TS_ENOMEM;
            break;
        }
        char err[TS__BERR_LEN] = "";
        ts_model_t *m = NULL;
        rc = cfg->create(cfg->create_arg, r->device, i, &m, err, sizeof(err));
        if (rc == 0 && (m == NULL || m->ops == NULL || m->ops->forward == NULL))
            rc = TS_EINVAL, snprintf(err, sizeof(err), "the factory returned no usable model");
        if (rc != 0) {
            set_err("model for replica %d on %s: %s", i, r->device, err[0] ? err : ts_strerror(rc));
            break;
        }
        r->model = m;
    }
    ts__free(devs);
    for (int i = 0; rc == 0 && i < b->n_rep; i++) {
        if (pthread_create(&b->rep[i].thread, NULL, replica_main, &b->rep[i]) != 0)
            rc = TS_ENOMEM;
        else
            b->rep[i].started = 1;
    }
    if (rc == 0) {
        if (pthread_create(&b->timer, NULL, timer_main, b) != 0)
            rc = TS_ENOMEM;
        else
            b->timer_started = 1;
    }
    if (rc != 0) {
        if (rc == TS_ENOMEM && tls_err[0] == '\0')
            set_err("out of memory");
        stop_threads(b);
        destroy(b);
        return rc;
    }
    *out = b;
    return 0;
}

#ifndef TS_BATCHER_NO_REMOTE
static void remote_stop(ts_batcher_t *b);
#endif

void ts_batcher_free(ts_batcher_t *b)
{
    if (b == NULL)
        return;
#ifndef TS_BATCHER_NO_REMOTE
    remote_stop(b);
#endif
    stop_threads(b);
    destroy(b);
}

int ts_batcher_replicas(const ts_batcher_t *b)
{
    return b->n_rep;
}

const char *ts_batcher_device(const ts_batcher_t *b, int i)
{
    return i >= 0 && i < b->n_rep ? b->rep[i].device : NULL;
}

void ts_batcher_stats(ts_batcher_t *b, ts_batcher_stats_t *out)
{
    pthread_mutex_lock(&b->mu);
    *out = b->st;
    out->queued = (uint32_t)b->queued;
    pthread_mutex_unlock(&b->mu);
}

/* ---------------------------------------------------------------------------------------------
 * Submitting
 */
int ts_batcher_submit(ts_batcher_t *b, const ts_value_t *input, unsigned flags, int timeout_ms,
                      ts_predict_cb cb, void *arg)
{
    if (b == NULL || input == NULL || cb == NULL) {
        set_err("submit needs a batcher, an input and a callback");
        return TS_EINVAL;
    }
    breq *r = ts__calloc(1, sizeof(*r) + (size_t)b->n_in * sizeof(r->leaf[0]));
    if (r == NULL)
        return TS_ENOMEM;
    if (flags & TS_COPY) {
        r->owned = ts_value_clone(input);
        if (r->owned == NULL) {
            ts__free(r);
            return TS_ENOMEM;
        }
        input = r->owned;
    }
    r->input = input;
    r->cb = cb;
    r->arg = arg;
    r->heap_idx = SIZE_MAX;
    char msg[TS__BERR_LEN];
    int rc = schema_check(b->in, b->n_in, input, b->max_batch, &r->rows, r->leaf, msg, sizeof(msg));
    if (rc != 0) {
        set_err("%s", msg);
        req_free(r);
        return rc;
    }
    int t = timeout_ms != 0 ? timeout_ms : b->timeout_ms;
    r->arrival_ns = now_ns();
    r->deadline_ns = t > 0 ? r->arrival_ns + (uint64_t)t * 1000000u : 0;
    pthread_mutex_lock(&b->mu);
    if (b->stopping || b->queued >= b->max_queued) {
        rc = b->stopping ? TS_ECANCELED : TS_EAGAIN;
        pthread_mutex_unlock(&b->mu);
        set_err("%s", b->stopping ? "the batcher is shutting down" : "the queue is full");
        req_free(r);
        return rc;
    }
    if (r->deadline_ns != 0) {
        if (heap_push(b, r) != 0) {
            pthread_mutex_unlock(&b->mu);
            req_free(r);
            return TS_ENOMEM;
        }
        /*
         * Wake the timer only for a deadline earlier than the one it sleeps until: with one
         * timeout for every request, deadlines arrive in order and it almost never is.
         */
        if (r->deadline_ns < b->timer_at) {
            b->timer_at = r->deadline_ns;
            pthread_cond_signal(&b->timer_cv);
        }
    }
    r->prev = b->tail;
    if (b->tail != NULL)
        b->tail->next = r;
    else
        b->head = r;
    b->tail = r;
    b->queued++;
    b->queued_rows += r->rows;
    /*
     * The gathering replica sleeps until its delay ends or the batch cannot grow; waking it
     * for every arrival would cost a context switch per request. The queue's rows reach
     * max_batch exactly when the batch from its head is full or the next request does not fit.
     *
     * A request submitted from a callback of this batcher's replica thread (a requester that
     * submits its next request as soon as it has its answer) wakes no idle replica: that
     * replica comes back to the queue right after its batch's callbacks and takes what they
     * queued, and if more than one batch is waiting it wakes another replica then. In a closed
     * loop the requests of a batch thus come back as the next batch without any thread being
     * woken, and idle replicas are not woken one by one to gather a few rows each.
     */
    if (b->collecting) {
        if (b->queued_rows >= b->max_batch)
            pthread_cond_signal(&b->collect_cv);
    } else if (tls_answering != b) {
        pthread_cond_signal(&b->work_cv);
    }
    pthread_mutex_unlock(&b->mu);
    return 0;
}

/*
 * A blocking call waiting for its callback. On Linux the requester sleeps on a futex word of
 * its own: the replica publishes the answer with one release store and wakes it with one
 * system call, where a mutex and a condition variable cost a second wake-up (the woken thread
 * blocks again on the mutex the signaller still holds). Elsewhere a mutex and a condition
 * variable of its own do the same job.
 */
typedef struct bsync {
#ifdef __linux__
    atomic_uint done;      /* 0, then 1 once the fields below hold the answer (release/acquire) */
    struct bsync *link;    /* the next answer of the same batch (replica side only) */
    struct bsync *wake[2]; /* requesters of the same batch this one wakes, or NULL */
#else
    pthread_mutex_t mu; /* its own: answering must not contend for the batcher's lock */
    pthread_cond_t cv;
    int done;
#endif
    int status;
    ts_value_t *output;
    int64_t version;
    char msg[TS__BERR_LEN];
} bsync;

#ifdef __linux__
/*
 * Answers of one batch are handed over as a chain: the replica publishes them all, wakes the
 * first requester, and each requester wakes up to two more as it leaves (see chain_flush). The
 * replica thus makes one wake-up per batch instead of one per request, and is not preempted by
 * every requester it wakes (on a machine with few cores each of those preemptions costs a context
 * switch); the requesters run on whatever cores are free meanwhile. Only a replica thread collects
 * such a chain (tls_chain); answers given elsewhere (deadlines, shutdown) wake their requester at
 * once.
 *
 * A wake may reach a word after its requester saw done and returned: a futex wake on a dead
 * address at worst wakes some later waiter there spuriously, and every futex waiter (these
 * ones included) rechecks its condition.
 */
static void futex_wake_one(atomic_uint *w)
{
    syscall(SYS_futex, (uint32_t *)w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

static void sync_wait(bsync *s)
{
    while (atomic_load_explicit(&s->done, memory_order_acquire) == 0)
        syscall(SYS_futex, (uint32_t *)&s->done, FUTEX_WAIT_PRIVATE, 0u, NULL, NULL, 0);
    for (int i = 0; i < 2; i++)
        if (s->wake[i] != NULL)
            futex_wake_one(&s->wake[i]->done);
}

static void sync_post(bsync *s)
{
    bchain *c = tls_chain;
    if (c != NULL) {
        /* Published by chain_flush: a requester seeing done must find its wake-ups set. */
        if (c->tail != NULL)
            c->tail->link = s;
        else
            c->head = s;
        c->tail = s;
        return;
    }
    atomic_store_explicit(&s->done, 1u, memory_order_release);
    futex_wake_one(&s->done);
}

/*
 * Publish a chain's answers, then wake its first requester. The wake-ups form a binary tree in
 * answer order (the i-th wakes the 2i+1-th and the 2i+2-th), so the last requester of a batch
 * of n is woken after about log2(n) hand-overs, not n: on a machine with idle cores a long
 * chain of hand-overs from core to core would add up to hundreds of microseconds.
 */
static void chain_flush(bchain *c)
{
    bsync *first = c->head;
    bsync *child = first != NULL ? first->link : NULL;
    for (bsync *s = first; s != NULL; s = s->link) {
        for (int i = 0; i < 2; i++) {
            s->wake[i] = child;
            if (child != NULL)
                child = child->link;
        }
    }
    for (bsync *s = first; s != NULL;) {
        bsync *next = s->link; /* read before publishing: s may be gone once done is set */
        atomic_store_explicit(&s->done, 1u, memory_order_release);
        s = next;
    }
    c->head = c->tail = NULL;
    if (first != NULL)
        futex_wake_one(&first->done);
}

static int sync_init(bsync *s)
{
    atomic_init(&s->done, 0u);
    s->link = NULL;
    s->wake[0] = s->wake[1] = NULL;
    return 0;
}

static void sync_destroy(bsync *s)
{
    (void)s;
}
#else
static void sync_wait(bsync *s)
{
    pthread_mutex_lock(&s->mu);
    while (!s->done)
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
}

static void sync_post(bsync *s)
{
    pthread_mutex_lock(&s->mu);
    s->done = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static int sync_init(bsync *s)
{
    if (pthread_mutex_init(&s->mu, NULL) != 0)
        return TS_ENOMEM;
    if (cond_init(&s->cv) != 0) {
        pthread_mutex_destroy(&s->mu);
        return TS_ENOMEM;
    }
    return 0;
}

static void sync_destroy(bsync *s)
{
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
}
#endif

static void sync_cb(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                    const char *message, void *arg)
{
    (void)b;
    bsync *s = arg;
    s->status = status;
    s->output = output;
    s->version = version;
    if (message != NULL)
        snprintf(s->msg, sizeof(s->msg), "%s", message);
    sync_post(s);
}

int ts_batcher_predict(ts_batcher_t *b, const ts_value_t *input, int timeout_ms,
                       ts_value_t **output, int64_t *version)
{
    if (tls_in_batcher) {
        set_err("ts_batcher_predict called from a batcher callback");
        return TS_EDEADLK;
    }
    bsync s;
    s.msg[0] = '\0';
    if (sync_init(&s) != 0)
        return TS_ENOMEM;
    int rc = ts_batcher_submit(b, input, 0, timeout_ms, sync_cb, &s);
    /* The timer thread answers at the deadline, and shutdown cancels: this wait ends. */
    if (rc == 0)
        sync_wait(&s);
    sync_destroy(&s);
    if (rc != 0)
        return rc;
    if (s.status != 0) {
        set_err("%s", s.msg);
        return s.status;
    }
    *output = s.output;
    if (version != NULL)
        *version = s.version;
    return 0;
}

#ifndef TS_BATCHER_NO_REMOTE
/* ---------------------------------------------------------------------------------------------
 * Remote use through tensord: the serving side
 */
#define TS__REMOTE_WAIT_MS                                                                         \
    200 /* ms; serve/follow/receive threads block in ts_wait this long,                            \
           then check whether they must stop */
#define TS__REMOTE_RETRY_NS 50000000u /* ns; pause after a failed call (the client reconnects) */
#define TS__GET_BATCHES     4 /* a serve thread takes up to this many max_batch worth of requests */

struct bremote {
    ts_batcher_t *b;
    ts_client_t *client;
    char req_bin[TS_MAX_NAME_LEN + 1];
    char params_bin[TS_MAX_NAME_LEN + 1];
    pthread_t serve_th, follow_th;
    int serving, following;
    atomic_int stop;
};

static void pause_ns(uint64_t ns)
{
    struct timespec ts = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    nanosleep(&ts, NULL);
}

/* The items of one ts_get, shared by the requests decoded from them. */
typedef struct ritems {
    atomic_int refs;
    ts_items_t *items;
} ritems;

static void ritems_unref(ritems *r)
{
    if (atomic_fetch_sub(&r->refs, 1) == 1) {
        ts_items_free(r->items);
        ts__free(r);
    }
}

/* One remote request in the batcher. */
typedef struct rreq {
    ts_client_t *client;
    ritems *items;
    int64_t id;
    char reply[TS_MAX_NAME_LEN + 1];
} rreq;

static void reply_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)status;
    (void)res;
    ts_value_free(arg); /* the reply record and the output views it holds */
}

/*
 * Append {id, status, version, output | error} to a reply bin. output is taken over. Failures
 * to send are dropped: the requester's own deadline covers them.
 */
static void send_reply(ts_client_t *client, const char *bin, int64_t id, int status,
                       ts_value_t *output, int64_t version, const char *msg)
{
    ts_value_t *rec = ts_map_new();
    int rc = rec != NULL ? 0 : TS_ENOMEM;
    if (rc == 0)
        rc = ts_map_set(rec, "id", ts_int_new(id));
    if (rc == 0)
        rc = ts_map_set(rec, "status", ts_int_new(status));
    if (rc == 0)
        rc = ts_map_set(rec, "version", ts_int_new(version));
    if (rc == 0 && status == 0) {
        rc = ts_map_set(rec, "output", output);
        output = NULL;
    } else if (rc == 0) {
        const char *m = msg != NULL ? msg : ts_strerror(status);
        rc = ts_map_set(rec, "error", ts_string_new(m, strlen(m)));
    }
    ts_value_free(output);
    if (rc != 0 || ts_append_async(client, bin, rec, 0, reply_sent, rec) != 0)
        ts_value_free(rec);
}

static void remote_done(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                        const char *message, void *arg)
{
    (void)b;
    rreq *r = arg;
    send_reply(r->client, r->reply, r->id, status, output, version, message);
    ritems_unref(r->items);
    ts__free(r);
}

/* Decode one request record and submit it; answer at once when it cannot be submitted. */
static void dispatch_one(bremote *rem, ritems *items, const ts_value_t *rec)
{
    int64_t id = 0, timeout_ms = 0;
    const char *reply = NULL;
    size_t reply_len = 0;
    if (ts_map_get_int(rec, "id", &id) != 0 ||
        ts_value_string(ts_map_get(rec, "reply"), &reply, &reply_len) != 0 || reply_len == 0 ||
        reply_len > TS_MAX_NAME_LEN)
        return; /* nobody to answer */
    if (ts_map_get(rec, "timeout_ms") != NULL)
        ts_map_get_int(rec, "timeout_ms", &timeout_ms);
    const ts_value_t *input = ts_map_get(rec, "input");
    rreq *r = ts__calloc(1, sizeof(*r));
    if (r == NULL) {
        send_reply(rem->client, reply, id, TS_ENOMEM, NULL, 0, "out of memory");
        return;
    }
    r->client = rem->client;
    r->items = items;
    r->id = id;
    memcpy(r->reply, reply, reply_len);
    atomic_fetch_add(&items->refs, 1);
    int t = timeout_ms > INT32_MAX ? INT32_MAX : timeout_ms < 0 ? -1 : (int)timeout_ms;
    int rc = input != NULL ? ts_batcher_submit(rem->b, input, 0, t, remote_done, r) : TS_ESCHEMA;
    if (rc != 0) {
        send_reply(rem->client, r->reply, id, rc, NULL, 0,
                   input != NULL ? ts_batcher_last_error() : "the request has no input");
        ritems_unref(items);
        ts__free(r);
    }
}

static void *serve_main(void *arg)
{
    bremote *rem = arg;
    size_t max_items = (size_t)rem->b->max_batch * TS__GET_BATCHES;
    uint64_t after = 0;
    int more = 0;
    while (!atomic_load(&rem->stop)) {
        uint64_t v = 0;
        if (!more) {
            int rc = ts_wait(rem->client, rem->req_bin, after, TS__REMOTE_WAIT_MS, &v, NULL);
            if (rc == TS_ETIMEDOUT)
                continue;
            if (rc != 0) {
                pause_ns(TS__REMOTE_RETRY_NS);
                continue;
            }
        }
        ts_items_t *items = NULL;
        int rc = ts_get(rem->client, rem->req_bin, max_items, &items);
        more = 0;
        if (rc == TS_ENOENT) {
            after = v > after ? v : after; /* another server took them */
            continue;
        }
        if (rc != 0) {
            pause_ns(TS__REMOTE_RETRY_NS);
            continue;
        }
        after = ts_items_version(items);
        more = ts_items_remaining(items) > 0;
        ritems *ri = ts__malloc(sizeof(*ri));
        if (ri == NULL) {
            ts_items_free(items);
            pause_ns(TS__REMOTE_RETRY_NS);
            continue;
        }
        atomic_init(&ri->refs, 1);
        ri->items = items;
        for (size_t i = 0; i < ts_items_count(items); i++)
            dispatch_one(rem, ri, ts_items_at(items, i));
        ritems_unref(ri);
    }
    return NULL;
}

static void params_release(const ts_value_t *params, void *arg)
{
    (void)params;
    ts_items_free(arg);
}

static void *follow_main(void *arg)
{
    bremote *rem = arg;
    uint64_t after = 0;
    while (!atomic_load(&rem->stop)) {
        uint64_t v = 0;
        int rc = ts_wait(rem->client, rem->params_bin, after, TS__REMOTE_WAIT_MS, &v, NULL);
        if (rc == TS_ETIMEDOUT)
            continue;
        if (rc != 0) {
            pause_ns(TS__REMOTE_RETRY_NS);
            continue;
        }
        ts_items_t *items = NULL;
        rc = ts_peek(rem->client, rem->params_bin, 0, &items);
        if (rc == TS_ENOENT) {
            after = v;
            continue;
        }
        if (rc != 0) {
            pause_ns(TS__REMOTE_RETRY_NS);
            continue;
        }
        after = ts_items_version(items);
        /* The newest item wins (a trainer puts one; appended ones are read newest first). */
        size_t n = ts_items_count(items);
        const ts_value_t *rec = n > 0 ? ts_items_at(items, n - 1) : NULL;
        const ts_value_t *params = rec != NULL ? ts_map_get(rec, "params") : NULL;
        int64_t version = 0;
        if (params == NULL || ts_map_get_int(rec, "version", &version) != 0 ||
            ts_batcher_set_weights(rem->b, params, version, params_release, items) != 0)
            ts_items_free(items);
    }
    return NULL;
}

/* The batcher's remote state, made on first use. Lock held. */
static bremote *remote_get(ts_batcher_t *b, ts_client_t *client)
{
    if (b->remote == NULL) {
        b->remote = ts__calloc(1, sizeof(*b->remote));
        if (b->remote == NULL)
            return NULL;
        b->remote->b = b;
        b->remote->client = client;
        atomic_init(&b->remote->stop, 0);
    }
    return b->remote->client == client ? b->remote : NULL;
}

int ts_batcher_serve(ts_batcher_t *b, ts_client_t *client, const char *name)
{
    if (b == NULL || client == NULL || name == NULL || name[0] == '\0' ||
        strlen(name) + strlen(TS_BATCHER_REQ_SUFFIX) > TS_MAX_NAME_LEN) {
        set_err("serve needs a client and a name of at most %d bytes",
                (int)(TS_MAX_NAME_LEN - strlen(TS_BATCHER_REQ_SUFFIX)));
        return TS_EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    bremote *rem = remote_get(b, client);
    int rc = rem == NULL ? TS_EINVAL : rem->serving ? TS_EINVAL : 0;
    if (rc == 0) {
        snprintf(rem->req_bin, sizeof(rem->req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
        if (pthread_create(&rem->serve_th, NULL, serve_main, rem) != 0)
            rc = TS_ENOMEM;
        else
            rem->serving = 1;
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != 0)
        set_err("already serving, or another client is in use");
    return rc;
}

int ts_batcher_follow_weights(ts_batcher_t *b, ts_client_t *client, const char *bin)
{
    if (b == NULL || client == NULL || bin == NULL || bin[0] == '\0' ||
        strlen(bin) > TS_MAX_NAME_LEN) {
        set_err("follow needs a client and a bin name");
        return TS_EINVAL;
    }
    pthread_mutex_lock(&b->mu);
    bremote *rem = remote_get(b, client);
    int rc = rem == NULL ? TS_EINVAL : rem->following ? TS_EINVAL : 0;
    if (rc == 0) {
        snprintf(rem->params_bin, sizeof(rem->params_bin), "%s", bin);
        if (pthread_create(&rem->follow_th, NULL, follow_main, rem) != 0)
            rc = TS_ENOMEM;
        else
            rem->following = 1;
    }
    pthread_mutex_unlock(&b->mu);
    if (rc != 0)
        set_err("already following, or another client is in use");
    return rc;
}

static void remote_stop(ts_batcher_t *b)
{
    pthread_mutex_lock(&b->mu);
    bremote *rem = b->remote;
    b->remote = NULL;
    pthread_mutex_unlock(&b->mu);
    if (rem == NULL)
        return;
    atomic_store(&rem->stop, 1);
    if (rem->serving) {
        /* Wake the serve thread from its ts_wait: a request without a reply bin is dropped by
           every server of the name. */
        ts_value_t *wake = ts_map_new();
        if (wake != NULL)
            ts_append(rem->client, rem->req_bin, wake, NULL);
        ts_value_free(wake);
        pthread_join(rem->serve_th, NULL);
    }
    if (rem->following)
        pthread_join(rem->follow_th, NULL);
    ts__free(rem);
}

void ts_batcher_stop_remote(ts_batcher_t *b)
{
    if (b != NULL)
        remote_stop(b);
}

/* ---------------------------------------------------------------------------------------------
 * Remote use through tensord: the requesting side
 */
typedef struct ppend {
    struct ppend *next;
    int64_t id;
    uint64_t deadline_ns; /* 0: none */
    ts_remote_cb cb;
    void *arg;
} ppend;

struct ts_predictor_s {
    ts_client_t *client;
    char req_bin[TS_MAX_NAME_LEN + 1];
    char reply_bin[TS_MAX_NAME_LEN + 1];
    pthread_mutex_t mu;
    pthread_cond_t cv; /* appends_inflight reached 0 */
    ppend *pending;
    int64_t next_id;
    int appends_inflight;
    atomic_int stop;
    pthread_t th;
};

static _Thread_local int tls_in_predictor;

/* Remove and return the pending request with this id, or NULL. Lock held. */
static ppend *pend_take(ts_predictor_t *p, int64_t id)
{
    for (ppend **pp = &p->pending; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->id == id) {
            ppend *r = *pp;
            *pp = r->next;
            return r;
        }
    }
    return NULL;
}

/* Hand one reply record to its pending request. */
static void deliver(ts_predictor_t *p, const ts_value_t *rec)
{
    int64_t id, status = TS_EPROTO, version = 0;
    if (ts_map_get_int(rec, "id", &id) != 0)
        return;
    pthread_mutex_lock(&p->mu);
    ppend *r = pend_take(p, id);
    pthread_mutex_unlock(&p->mu);
    if (r == NULL)
        return; /* it timed out already */
    ts_map_get_int(rec, "status", &status);
    ts_map_get_int(rec, "version", &version);
    ts_value_t *out = NULL;
    const char *msg = NULL;
    size_t len;
    if (status == 0) {
        out = ts_value_clone(ts_map_get(rec, "output"));
        if (out == NULL)
            status = ts_map_get(rec, "output") == NULL ? TS_EPROTO : TS_ENOMEM;
    } else if (ts_value_string(ts_map_get(rec, "error"), &msg, &len) != 0) {
        msg = NULL;
    }
    r->cb(p, (int)status, out, version, status != 0 ? (msg ? msg : ts_strerror((int)status)) : NULL,
          r->arg);
    ts__free(r);
}

/* Fail every pending request whose deadline passed (all of them when now_ns is UINT64_MAX). */
static void expire(ts_predictor_t *p, uint64_t t, int status, const char *msg)
{
    for (;;) {
        ppend *r = NULL;
        pthread_mutex_lock(&p->mu);
        for (ppend **pp = &p->pending; *pp != NULL; pp = &(*pp)->next) {
            if ((*pp)->deadline_ns != 0 ? (*pp)->deadline_ns <= t : t == UINT64_MAX) {
                r = *pp;
                *pp = r->next;
                break;
            }
        }
        pthread_mutex_unlock(&p->mu);
        if (r == NULL)
            return;
        r->cb(p, status, NULL, 0, msg, r->arg);
        ts__free(r);
    }
}

static void *receive_main(void *arg)
{
    ts_predictor_t *p = arg;
    tls_in_predictor = 1;
    uint64_t after = 0;
    while (!atomic_load(&p->stop)) {
        int wait_ms = TS__REMOTE_WAIT_MS;
        pthread_mutex_lock(&p->mu);
        uint64_t t = now_ns();
        for (const ppend *r = p->pending; r != NULL; r = r->next) {
            if (r->deadline_ns != 0) {
                uint64_t left = r->deadline_ns > t ? (r->deadline_ns - t) / 1000000u + 1 : 0;
                if (left < (uint64_t)wait_ms)
                    wait_ms = (int)left;
            }
        }
        pthread_mutex_unlock(&p->mu);
        uint64_t v = 0;
        int rc = ts_wait(p->client, p->reply_bin, after, wait_ms, &v, NULL);
        expire(p, now_ns(), TS_ETIMEDOUT, "no answer before the deadline");
        if (rc == TS_ETIMEDOUT)
            continue;
        if (rc != 0) {
            pause_ns(TS__REMOTE_RETRY_NS);
            continue;
        }
        ts_items_t *items = NULL;
        rc = ts_get(p->client, p->reply_bin, 0, &items);
        if (rc != 0) {
            after = rc == TS_ENOENT ? v : after;
            continue;
        }
        after = ts_items_version(items);
        for (size_t i = 0; i < ts_items_count(items); i++)
            deliver(p, ts_items_at(items, i));
        ts_items_free(items);
    }
    return NULL;
}

int ts_predictor_open(ts_predictor_t **out, ts_client_t *client, const char *name)
{
    /* Room for "NAME/reply/" + 16 hex digits, and for "NAME/requests". */
    if (out == NULL || client == NULL || name == NULL || name[0] == '\0' ||
        strlen(name) + 7 + 16 > TS_MAX_NAME_LEN) {
        set_err("a predictor needs a client and a short enough name");
        return TS_EINVAL;
    }
    ts_predictor_t *p = ts__calloc(1, sizeof(*p));
    if (p == NULL)
        return TS_ENOMEM;
    p->client = client;
    snprintf(p->req_bin, sizeof(p->req_bin), "%s%s", name, TS_BATCHER_REQ_SUFFIX);
    /* A reply bin name nobody else picks: time, address and a process-wide counter, mixed. */
    static atomic_uint_fast64_t counter;
    uint64_t x = now_ns() ^ ((uint64_t)(uintptr_t)p << 16) ^
                 (atomic_fetch_add(&counter, 1) * 0x9E3779B97F4A7C15u);
    x ^= (uint64_t)getpid() << 40;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9u;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBu;
    x ^= x >> 31;
    snprintf(p->reply_bin, sizeof(p->reply_bin), "%s/reply/%016llx", name, (unsigned long long)x);
    pthread_mutex_init(&p->mu, NULL);
    cond_init(&p->cv);
    p->next_id = 1;
    atomic_init(&p->stop, 0);
    if (pthread_create(&p->th, NULL, receive_main, p) != 0) {
        pthread_cond_destroy(&p->cv);
        pthread_mutex_destroy(&p->mu);
        ts__free(p);
        return TS_ENOMEM;
    }
    *out = p;
    return 0;
}

void ts_predictor_free(ts_predictor_t *p)
{
    if (p == NULL)
        return;
    atomic_store(&p->stop, 1);
    /* Wake the receiver from its ts_wait: an item without a pending id is ignored. */
    ts_value_t *wake = ts_map_new();
    if (wake != NULL && ts_map_set(wake, "id", ts_int_new(0)) == 0)
        ts_append(p->client, p->reply_bin, wake, NULL);
    ts_value_free(wake);
    pthread_join(p->th, NULL);
    /* Appends still in flight call back into p: wait for them (bounded by the client). */
    pthread_mutex_lock(&p->mu);
    while (p->appends_inflight > 0)
        pthread_cond_wait(&p->cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    expire(p, UINT64_MAX, TS_ECANCELED, "the predictor was freed");
    ts_delete(p->client, p->reply_bin, NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    ts__free(p);
}

/* A tree of the same shape whose tensors and bytes borrow v's memory. NULL on ENOMEM. */
static ts_value_t *mirror(const ts_value_t *v)
{
    switch (ts_value_type(v)) {
    case TS_TYPE_MAP:
    case TS_TYPE_LIST: {
        int map = ts_value_type(v) == TS_TYPE_MAP;
        ts_value_t *c = map ? ts_map_new() : ts_list_new();
        for (size_t i = 0; c != NULL && i < ts_value_len(v); i++) {
            ts_value_t *child = mirror(map ? ts_map_value_at(v, i) : ts_list_at(v, i));
            int rc = map ? ts_map_set(c, ts_map_key_at(v, i), child) : ts_list_push(c, child);
            if (rc != 0) {
                ts_value_free(c);
                c = NULL;
            }
        }
        return c;
    }
    case TS_TYPE_TENSOR: {
        const ts_tensor_t *t = ts_value_tensor(v);
        return ts_tensor_new(t->dtype, t->ndim, t->shape, t->data, TS_BORROW);
    }
    case TS_TYPE_BYTES: {
        const void *d;
        size_t n;
        ts_value_bytes(v, &d, &n);
        return ts_bytes_new(d, n, TS_BORROW);
    }
    default:
        return ts_value_clone(v);
    }
}

typedef struct psent {
    ts_predictor_t *p;
    int64_t id;
} psent;

static void request_sent(ts_client_t *c, int status, ts_result_t *res, void *arg)
{
    (void)c;
    (void)res;
    psent *s = arg;
    ts_predictor_t *p = s->p;
    ppend *r = NULL;
    pthread_mutex_lock(&p->mu);
    if (status != 0)
        r = pend_take(p, s->id);
    pthread_mutex_unlock(&p->mu);
    if (r != NULL) {
        /* On the client's I/O thread: a blocking predict from this callback must fail. */
        int was = tls_in_predictor;
        tls_in_predictor = 1;
        r->cb(p, status, NULL, 0, "sending the request failed", r->arg);
        tls_in_predictor = was;
        ts__free(r);
    }
    pthread_mutex_lock(&p->mu);
    if (--p->appends_inflight == 0)
        pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    ts__free(s);
}

int ts_predictor_submit(ts_predictor_t *p, const ts_value_t *input, int timeout_ms, ts_remote_cb cb,
                        void *arg)
{
    if (p == NULL || input == NULL || cb == NULL)
        return TS_EINVAL;
    int t = timeout_ms != 0 ? timeout_ms : TS__DEFAULT_TIMEOUT_MS;
    ppend *r = ts__calloc(1, sizeof(*r));
    psent *s = ts__calloc(1, sizeof(*s));
    ts_value_t *rec = ts_map_new();
    if (r == NULL || s == NULL || rec == NULL) {
        ts__free(r);
        ts__free(s);
        ts_value_free(rec);
        return TS_ENOMEM;
    }
    pthread_mutex_lock(&p->mu);
    int64_t id = p->next_id++;
    pthread_mutex_unlock(&p->mu);
    int rc = ts_map_set(rec, "id", ts_int_new(id));
    if (rc == 0)
        rc = ts_map_set(rec, "reply", ts_string_new(p->reply_bin, strlen(p->reply_bin)));
    if (rc == 0)
        rc = ts_map_set(rec, "timeout_ms", ts_int_new(t));
    if (rc == 0)
        rc = ts_map_set(rec, "input", mirror(input));
    if (rc != 0) {
        ts__free(r);
        ts__free(s);
        ts_value_free(rec);
        return rc;
    }
    r->id = id;
    r->deadline_ns = t > 0 ? now_ns() + (uint64_t)t * 1000000u : 0;
    r->cb = cb;
    r->arg = arg;
    s->p = p;
    s->id = id;
    pthread_mutex_lock(&p->mu);
    r->next = p->pending;
    p->pending = r;
    p->appends_inflight++;
    pthread_mutex_unlock(&p->mu);
    /* TS_COPY: the request is encoded and its tensors copied now, so input stays borrowed. */
    rc = ts_append_async(p->client, p->req_bin, rec, TS_COPY, request_sent, s);
    ts_value_free(rec);
    if (rc != 0) {
        pthread_mutex_lock(&p->mu);
        ppend *mine = pend_take(p, id);
        p->appends_inflight--;
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        ts__free(mine);
        ts__free(s);
        set_err("sending the request failed: %s", ts_strerror(rc));
        return rc;
    }
    return 0;
}

typedef struct psync {
    pthread_mutex_t *mu; /* the predictor's: it outlives the wait */
    pthread_cond_t cv;
    int done, status;
    ts_value_t *output;
    int64_t version;
    char msg[TS__BERR_LEN];
} psync;

static void psync_cb(ts_predictor_t *p, int status, ts_value_t *output, int64_t version,
                     const char *message, void *arg)
{
    (void)p;
    psync *s = arg;
    pthread_mutex_lock(s->mu);
    s->status = status;
    s->output = output;
    s->version = version;
    snprintf(s->msg, sizeof(s->msg), "%s", message != NULL ? message : "");
    s->done = 1;
    pthread_cond_signal(&s->cv);
    pthread_mutex_unlock(s->mu);
}

int ts_predictor_predict(ts_predictor_t *p, const ts_value_t *input, int timeout_ms,
                         ts_value_t **output, int64_t *version)
{
    if (tls_in_predictor || tls_in_batcher) {
        set_err("ts_predictor_predict called from a callback");
        return TS_EDEADLK;
    }
    psync s;
    memset(&s, 0, sizeof(s));
    s.mu = &p->mu;
    if (cond_init(&s.cv) != 0)
        return TS_ENOMEM;
    int rc = ts_predictor_submit(p, input, timeout_ms, psync_cb, &s);
    if (rc == 0) {
        /* The receiver thread answers at the deadline at the latest; free cancels. */
        pthread_mutex_lock(&p->mu);
        while (!s.done)
            pthread_cond_wait(&s.cv, &p->mu);
        pthread_mutex_unlock(&p->mu);
        rc = s.status;
    }
    pthread_cond_destroy(&s.cv);
    if (rc != 0) {
        if (s.done)
            set_err("%s", s.msg);
        return rc;
    }
    *output = s.output;
    if (version != NULL)
        *version = s.version;
    return 0;
}
#endif /* TS_BATCHER_NO_REMOTE */
