/*
 * What the files of the batcher share (batcher/): its limits, the engine's state, and the
 * functions one file offers the others. Not installed. The batcher is built on the public API
 * only (include/tensorshare/) plus the allocation hooks (hooks.h); nothing here reaches into the
 * client's or the core's internals.
 *
 * The files: batcher.c is the engine (queue, deadline heap, weight updates, replicas, gathering
 * and slicing, creation and shutdown, submitting); schema.c matches value trees against the
 * dotted-path schemas; placement.c expands a placement such as "cuda:0*2,cpu:4"; handoff.c
 * (handoff.h) wakes blocking requesters; serve.c serves a batcher through tensord and
 * predictor.c requests through tensord. The engine does not depend on serve.c or predictor.c:
 * the in-process test links it without them.
 */
#ifndef TS_BATCHER_INTERNAL_H
#define TS_BATCHER_INTERNAL_H

#include "tensorshare/batcher.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "hooks.h"

#define TS__BERR_LEN           256 /* bytes; error messages the batcher formats and keeps per answer */
#define TS__MAX_REPLICAS       256   /* replicas per batcher; a sanity bound on placement */
#define TS__DEVICE_LEN         32    /* bytes; "cuda:NNN" and room to spare */
#define TS__DEFAULT_MAX_BATCH  64    /* rows */
#define TS__DEFAULT_DELAY_US   500   /* microseconds, Triton's usual order of magnitude */
#define TS__DEFAULT_TIMEOUT_MS 30000 /* milliseconds, the client's request timeout */
#define TS__DEFAULT_MAX_QUEUED 65536 /* requests */
/*
 * requests; the most freed request records an answering thread keeps for its next submits, as
 * a multiple of max_batch (a closed loop resubmits one batch's worth), and at most
 * TS__REQ_CACHE_MAX (about 0.5 MiB of records per answering thread with one input field).
 */
#define TS__REQ_CACHE_BATCHES 2
#define TS__REQ_CACHE_MAX     4096
/* request ids an answering thread takes from the batcher's counter at a time */
#define TS__ID_BLOCK 256
/*
 * batches; while holding partial batches for returning requesters gains less than a row per
 * hold, one batch in this many holds anyway, to notice when it pays again (gather())
 */
#define TS__HOLD_PROBE 16
/* rows gained per row waiting, times 16; one hold counts at most this much in the average */
#define TS__HOLD_GAIN_CAP16 256
/* requests; room under max_queued an answering thread reserves at a time (ctx_reserve) */
#define TS__PENDING_BLOCK 64

/*
 * Tests only (NULL otherwise): called on a replica's thread, without the lock, as it starts
 * looking for the requests of answers being handed out (overlap_answers), so that a test can
 * act during the look.
 */
extern void (*ts__batcher_look_hook)(void);

/* Set the calling thread's ts_last_error() message, printf-style (cut at TS__BERR_LEN). */
void ts__batcher_set_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Nonzero on the batcher's own threads, where a blocking call would wait for itself. */
int ts__batcher_on_own_thread(void);

/* ---------------------------------------------------------------------------------------------
 * Schemas (schema.c)
 */
/* One field of a schema: a dotted path to a tensor and its per-row dtype and shape. */
typedef struct schema_field {
    char *name;   /* the dotted name, owned */
    char **parts; /* path components (pointers into path_buf); NULL for a bare tensor */
    char *path_buf;
    int nparts;
    ts_dtype_t dtype;
    int ndim; /* per row */
    int64_t shape[TS_MAX_NDIM];
    size_t row_bytes;
} schema_field;

/* Copy and check a schema (what names it in messages). 0, TS_EINVAL (message set), TS_ENOMEM. */
int ts__schema_copy(const ts_field_t *in, int n, const char *what, schema_field **out);
void ts__schema_free(schema_field *f, int n);
/*
 * Check a tree against a schema. rows: in, the expected row count (or 0 to learn it, then
 * 1..max_rows); out, the row count. leaves (may be NULL) receives each field's tensor. 0, or
 * TS_ESCHEMA with a message in msg.
 */
int ts__schema_check(const schema_field *f, int n, const ts_value_t *root, int64_t max_rows,
                     int64_t *rows, const ts_tensor_t **leaves, char *msg, size_t msglen);
/*
 * A tree of freshly allocated tensors for a schema, each with rows rows. leaves receives each
 * field's value (owned by the tree). The root, or NULL (ENOMEM).
 */
ts_value_t *ts__schema_alloc(const schema_field *f, int n, int64_t rows, ts_value_t **leaves);
/*
 * Check a model's output: against the output schema when there is one (n > 0), else every tensor
 * must have rows rows. 0 or TS_ESCHEMA with a message.
 */
int ts__output_check(const schema_field *f, int n, const ts_value_t *v, int64_t rows, char *msg,
                     size_t msglen);

/* ---------------------------------------------------------------------------------------------
 * Placement (placement.c)
 */
/*
 * Expand a placement ("cpu", "cuda:0*2,cpu:4", ...; NULL or "" is "cpu") into one device name
 * per replica in devs (TS__MAX_REPLICAS entries). 0, TS_EINVAL or TS_ENOTSUP (message set).
 */
int ts__placement_parse(const char *spec, int cuda_devices, char (*devs)[TS__DEVICE_LEN], int *n);

/* ---------------------------------------------------------------------------------------------
 * The remote side (serve.c, predictor.c)
 */
/* ms; serve, follow and receive threads block in ts_wait this long, then check for a stop. */
#define TS__REMOTE_WAIT_MS 200
/* ns; the pause after a failed call, while the client reconnects. */
#define TS__REMOTE_RETRY_NS 50000000u
/*
 * ms; the longest a stopping server waits for its taking chain's last call to end; a call that
 * waits for a reconnection is not waited for at all (serve.c, chain_wait).
 */
#define TS__REMOTE_STOP_MS 2000

/* Sleep ns nanoseconds (a retry's pause; an interrupted sleep just ends early). */
static inline void ts__remote_pause(uint64_t ns)
{
    struct timespec ts = ts__abs_timespec(ns);
    nanosleep(&ts, NULL);
}

/* ---------------------------------------------------------------------------------------------
 * The engine's state (batcher.c); serve.c uses the lock, max_batch and the remote slot.
 */
/* One queued request. */
typedef struct batch_request {
    struct batch_request *prev, *next; /* queue links */
    ts_value_t *owned;                 /* a copy of the input (TS_COPY), freed after the callback */
    const ts_value_t *input;
    int64_t rows;
    uint64_t arrival_ns;
    uint64_t deadline_ns; /* 0: none */
    uint64_t id;          /* for ts_batcher_cancel */
    int prio;             /* priority level, 0 most urgent */
    int fail;             /* on the timer's list: TS_ETIMEDOUT, else cancelled */
    size_t heap_idx;      /* position in the deadline heap, or SIZE_MAX */
    ts_predict_cb cb;
    void *arg;
    const ts_tensor_t *leaf[]; /* one per input field */
} batch_request;

/*
 * What a thread that calls a batcher's callbacks (a replica's, an answer helper's) keeps for
 * the requests those callbacks submit (see ts_batcher_predict_async_with): they are collected
 * here, without the batcher's lock, and queued together under one acquisition of it when the
 * thread has finished its callbacks (answer_ctx_flush). The list has a lock of its own, taken
 * only by its thread and by ts_batcher_cancel (which takes the batcher's lock first), so that
 * a request waiting here can still be cancelled. The free list is touched by its thread alone.
 */
typedef struct answer_ctx {
    struct ts_batcher_s *b;
    int active;                 /* its thread is calling callbacks now */
    uint64_t now_ns;            /* when it began calling them (the submits' arrival) */
    atomic_flag lock;           /* guards head, tail and n (a spin lock: see ctx_lock) */
    batch_request *head, *tail; /* submitted from callbacks, not queued yet (prev/next) */
    size_t n;
    batch_request *free_list; /* freed records for the next submits (linked by next) */
    size_t n_free, max_free;
    uint64_t id_next, id_end; /* the ids it gives its submits: [id_next, id_end) */
    size_t credit;            /* units of b->pending reserved and not used yet (ctx_reserve) */
} answer_ctx;

/* A published weight update. */
typedef struct weight_update {
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
    struct weight_waiter *waiter; /* a blocking ts_batcher_load_weights, or NULL */
} weight_update;

/* A blocking ts_batcher_load_weights waiting for the replicas. */
typedef struct weight_waiter {
    pthread_cond_t cv;
    weight_update *w; /* valid until released */
    int finished;     /* every replica done, or the update was replaced */
    int released;
    int err;
    char msg[TS__BERR_LEN];
} weight_waiter;

/* One model replica and its thread. */
typedef struct replica {
    ts_batcher_t *b;
    int index;
    char device[TS__DEVICE_LEN];
    ts_model_t *model;
    pthread_t thread;
    int started;
    uint64_t gen;                  /* generation of the last weight update handled */
    int64_t version;               /* weights in the model now */
    ts_value_t *batch;             /* max_batch rows of every input field */
    ts_value_t **batch_leaf;       /* per field: the tensor value inside batch */
    batch_request **picked;        /* the requests of the current batch */
    ts_batcher_replica_stats_t st; /* under the batcher's lock */
    answer_ctx ctx;                /* the requests its callbacks submit */
    /*
     * overlap_answers: the batches whose answers this replica handed to the helpers, each with
     * its own array of requests (picked is the array of the slot being gathered into).
     */
    struct answer_slot *slots; /* TS__ANSWER_SLOTS of them, or NULL */
    int slot_next;             /* the slot picked belongs to */
    struct output_box *outbox; /* its batch outputs released elsewhere, freed here (batcher.c) */
} replica;

/*
 * batches; with overlap_answers, a replica's batches handed to the helpers and not answered yet,
 * plus the one it gathers or computes: two are double buffering (one batch computes while the
 * one before it is answered).
 */
#define TS__ANSWER_SLOTS 2

/*
 * ns; an answer helper that finds no part to answer keeps looking (yielding the core between
 * looks) this long before it sleeps, and with overlap_answers so does a replica that finds the
 * queue empty while parts are being answered (their callbacks are about to submit): a part
 * posted meanwhile, or requests queued meanwhile, cost no futex wake-up and no wake-up latency
 * (tens of microseconds on a virtual machine, as long as answering a batch of a small model).
 * Bounded, as shmq.c's looks: an idle batcher stops spending CPU almost at once.
 */
#define TS__ANSWER_SPIN_NS 50000u

/* One batch handed to the helpers (overlap_answers): its requests and its parts. */
typedef struct answer_slot {
    batch_request **reqs;      /* max_batch entries */
    struct answer_part *parts; /* one per helper */
    int left;                  /* parts not answered yet; under ans_mu */
} answer_slot;

/* A part of a batch's answers given to the helper threads (answer_threads). */
typedef struct answer_part {
    struct answer_part *next;
    batch_request **reqs;
    int n;
    int64_t off; /* the first request's first row in the batch output */
    const ts_value_t *out;
    struct shared_output *shared;
    int64_t version;
    struct answer_join *join; /* counts the parts still being answered, or NULL: */
    struct replica *rep;      /* ... overlap_answers: the replica whose batch this is */
    answer_slot *slot;        /* ... and the slot that holds its requests */
} answer_part;

/* The remote serving state (serve.c), opaque to the engine. */
typedef struct remote_server remote_server;

struct ts_batcher_s {
    pthread_mutex_t mu;
    pthread_cond_t work_cv;    /* idle replicas: a request or weights arrived, or stopping */
    pthread_cond_t collect_cv; /* the gathering replica: more rows arrived */
    pthread_cond_t timer_cv;   /* the timer: the earliest deadline changed */
    schema_field *in;
    int n_in;
    schema_field *out;
    int n_out;
    int64_t max_batch;
    uint64_t max_delay_ns;
    int timeout_ms;
    size_t max_queued;
    replica *rep;
    int n_rep;
    /*
     * The queue: one list in batch order, by priority level (0 first), then arrival. tails[p] is
     * the last request of level p, or NULL when the level has none.
     */
    batch_request *head, *tail;
    batch_request *tails[TS_BATCHER_MAX_PRIORITIES];
    int levels, default_prio;
    int64_t preferred[TS_BATCHER_MAX_PREFERRED]; /* ascending */
    int n_preferred;
    uint64_t min_delay_ns;
    /*
     * Requesters answered by batches that have not submitted again since (each submit takes
     * one off; zero when a batch waited out max_delay): see gather().
     */
    size_t returning;
    uint64_t forward_ns; /* a forward's duration, a moving average (see gather()) */
    /*
     * What holding a partial batch for returning requesters has gained: the rows that joined
     * during a hold per row that was waiting, times 16, a moving average over about eight holds;
     * and the batches gathered without a hold since the last one. See gather().
     */
    uint32_t hold_gain16, hold_skips;
    /* The answer helpers (opts.answer_threads): their own lock, queue of parts and threads. */
    pthread_mutex_t ans_mu;
    pthread_cond_t ans_cv;
    pthread_cond_t slot_cv; /* overlap_answers: a replica waits for a slot's answers */
    int overlap;            /* overlap_answers (with helpers) */
    answer_part *ans_head, *ans_tail;
    atomic_uint ans_posted; /* parts posted so far (for the helpers' looks) */
    atomic_int ans_open;    /* overlap_answers: parts posted and not answered yet */
    int ans_stop;
    int n_answerers;
    pthread_t *answerers;
    answer_ctx *answerer_ctx; /* one per helper */
    int n_answerer_ctx;       /* initialized ones */
    batch_request *cancelled; /* cancelled requests the timer thread answers (linked by next) */
    _Atomic uint64_t next_id;
    /*
     * Requests waiting in answering threads' lists (answer_ctx) plus the room those threads
     * reserved for more (ctx_reserve), and the queue's length as last published under the
     * lock: a submit from a callback checks max_queued against both without the lock.
     * stop_flag mirrors stopping for it.
     */
    atomic_size_t pending;
    atomic_size_t queued_hint;
    atomic_int stop_flag;
    size_t queued;
    int64_t queued_rows;  /* rows of the queued requests */
    batch_request **heap; /* min-heap on deadline_ns */
    size_t heap_len, heap_cap;
    int collecting; /* a replica is gathering a batch */
    int stopping;
    pthread_t timer;
    int timer_started;
    uint64_t timer_at; /* the deadline the timer sleeps until; UINT64_MAX: none */
    weight_update *wt; /* the latest update, or NULL */
    uint64_t wt_gen;
    ts_batcher_stats_t st;
    /*
     * Set under the lock by serve.c when remote serving starts; ts_batcher_free calls
     * remote_stop (without the lock) before stopping the replicas. The engine knows nothing else
     * of the remote side, so it links without serve.c.
     */
    remote_server *remote;
    void (*remote_stop)(ts_batcher_t *b);
};

#endif /* TS_BATCHER_INTERNAL_H */
