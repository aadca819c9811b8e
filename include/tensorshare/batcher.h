/*
 * tensorshare batcher: dynamic batching of inference requests over model replicas.
 *
 * Many small requesters (threads of this process, or workers on other machines through a
 * tensord) each submit a few rows; the batcher gathers queued requests into batches of at most
 * max_batch rows, runs each batch on one model replica, and hands every requester exactly its
 * own rows of the answer, together with the weight version the answer was computed with.
 *
 * The batcher knows nothing about libtorch: a model is a small function table (ts_model_ops_t).
 * The libtorch shim (tensorshare/torch.h) provides the TorchScript implementation; any C code
 * can provide another.
 *
 * Batching rule (like Triton's dynamic batcher): an idle replica takes the first queued request
 * (the most urgent priority level first, then in arrival order), then keeps adding the following
 * queued requests, in order, while they fit in max_batch rows. It runs at once when the batch is
 * full, when the next queued request does not fit, when the rows reach a preferred batch size,
 * or when no further request can be expected soon: every requester the batcher knows of is
 * already waiting (queued or in a batch; so a lone request to an idle batcher runs at once).
 * Otherwise, while requesters that a batch answered have not submitted again, it waits for
 * them, but no longer than about one forward takes (from when the replica began gathering),
 * and not at all while such waits have lately gained fewer rows than were already waiting (one
 * batch in 16 waits anyway, to see whether waiting pays again). A partial batch is still held at
 * least min_delay_us after its oldest request's arrival, and never past max_delay_us after it. A
 * request is never split over two batches. While one replica is gathering a batch, the other idle
 * replicas wait for it to finish gathering, so that one batch fills before the next starts.
 * docs/BATCHER.md has the details and the measurements behind the defaults.
 *
 * Threads: each replica runs on its own thread ("ts-replica-N"); a timer thread ("ts-timer")
 * enforces request deadlines; answer helpers ("ts-answer-N", answer_threads) are optional. The
 * names are what top -H, perf and /proc/PID/task/TID/comm show (since 0.7.0). On Linux a replica
 * thread's timer slack is 1 ns (prctl PR_SET_TIMERSLACK), so that its short timed waits (a
 * partial batch held for about a forward) end on time; callbacks that run on it see that slack.
 * Every function here is thread-safe unless its comment says otherwise.
 */
#ifndef TENSORSHARE_BATCHER_H
#define TENSORSHARE_BATCHER_H

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * The model interface Added in 0.1.0.
 */
typedef struct ts_model_s ts_model_t;

/* The operations of a model, called by the batcher. Added in 0.1.0. */
typedef struct ts_model_ops_s {
    /*
     * Run one batch. input is a value tree that matches the batcher's input schema, every tensor
     * with a leading batch dimension of rows (borrowed for the call). On success, store a tree
     * you own in *output (transferred to the batcher) whose tensors all have the leading
     * dimension rows; on failure return a TS_E* code and set the reason with ts_set_last_error()
     * (the batcher hands it to the requesters' callbacks through ts_last_error()). Called on the
     * replica's thread only, never concurrently with another call on the same model.
     */
    int (*forward)(ts_model_t *m, const ts_value_t *input, int64_t rows, ts_value_t **output);
    /*
     * Load new weights (a state dict: a map of name to tensor, nested maps allowed) borrowed for
     * the call. Called on the replica's thread between two forwards, never during one. May be
     * NULL when the model has no weights to load (updates then fail with TS_ENOTSUP). A failure
     * returns a TS_E* code with its reason set by ts_set_last_error(), as for forward (any other
     * non-zero value is reported as TS_EMODEL).
     */
    int (*load_weights)(ts_model_t *m, const ts_value_t *params);
    /* Free the model. Called once, on the thread that frees the batcher. */
    void (*free)(ts_model_t *m);
} ts_model_ops_t;

/*
 * Embed this as the first member of your model struct (like a libuv handle). Added in 0.1.0.
 * Changed in 0.2.0: forward and load_weights lost their err and errlen parameters.
 */
struct ts_model_s {
    const ts_model_ops_t *ops;
    void *data; /* for the implementation; the batcher never reads it */
};

/*
 * Create one replica's model for device ("cpu" or "cuda:N"); replica numbers count from 0.
 * Called by ts_batcher_new on its caller's thread, once per replica; arg is the options'
 * create_arg. On failure return a TS_E* code with its reason set by ts_set_last_error();
 * ts_batcher_new then frees the replicas already made and fails with that code and message
 * (any other non-zero value, positive or not a TS_E* code, becomes TS_EMODEL with a message
 * that gives the value).
 * Added in 0.1.0. Changed in 0.2.0: arg comes last; err and errlen are gone.
 */
typedef int (*ts_model_create_cb)(const char *device, int replica, ts_model_t **out, void *arg);

/* ---------------------------------------------------------------------------------------------
 * Options
 */

/*
 * One tensor of a schema. name is a dotted path into nested maps ("obs.image" is the tensor
 * under key "image" of the map under key "obs"); the empty name means the whole value is this
 * one tensor (a schema with a single unnamed field takes and returns bare tensors). shape is
 * per row: it leaves out the batch dimension. A dimension may be 0 (the field's rows then hold
 * no values, as a tensor of such a shape does); a negative one gives TS_EINVAL at
 * ts_batcher_new. Added in 0.1.0.
 */
typedef struct ts_field_s {
    const char *name;
    ts_dtype_t dtype;
    int ndim;
    int64_t shape[TS_MAX_NDIM];
} ts_field_t;

/* tensors per schema; a request is checked leaf by leaf. Added in 0.1.0. */
#define TS_BATCHER_MAX_FIELDS 64

/*
 * The batcher's options; fill with ts_batcher_options_init, then change fields. Added in 0.2.0.
 * It replaces ts_batcher_config_t.
 */
typedef struct ts_batcher_options_s {
    const ts_field_t *inputs; /* input schema (copied by ts_batcher_new) */
    int n_inputs;
    /*
     * Output schema (copied), or n_outputs = 0 to accept whatever tree the model returns as long
     * as every tensor in it has the batch's row count as its leading dimension.
     */
    const ts_field_t *outputs;
    int n_outputs;
    int max_batch; /* rows per forward (at least 1); default 64 */
    /*
     * Wait at most this long for more rows after the oldest request's arrival, while the batch
     * can still grow and more requests can be expected (see the batching rule); default 500.
     */
    int64_t max_delay_us;
    /*
     * Where replicas run, a comma-separated list (default "cpu"; NULL and "" also mean "cpu"):
     *   cpu        one replica on a CPU thread;   cpu:N   N replicas on CPU threads
     *   cuda:I     one replica on CUDA device I;  cuda:I*K  K replicas on device I
     *   cuda*K     K replicas on every CUDA device (cuda_devices of them; "cuda" = cuda*1)
     *   cuda/N     N replicas round-robin over the CUDA devices
     * e.g. "cuda:0,cuda:1" places one replica on each of two GPUs.
     */
    const char *placement;
    int cuda_devices; /* visible CUDA devices, for the cuda, cuda*K and cuda/N forms */
    /*
     * What TS_TIMEOUT_DEFAULT means for this batcher's predictions and blocking weight loads:
     * positive milliseconds, or TS_TIMEOUT_INFINITE for no deadline (0 gives TS_EINVAL at
     * ts_batcher_new); default 30000.
     */
    int timeout_ms;
    /* requests waiting at most; further ones get TS_EAGAIN; default (and 0 means) 65536 */
    size_t max_queued;
    int64_t version;           /* weight version the models start with; default 0 */
    ts_model_create_cb create; /* required */
    void *create_arg;          /* passed to create; never read by the batcher */
    /*
     * Hold a partial batch at least this long after its oldest request's arrival, even when no
     * further request is expected (a full batch, or one whose next request does not fit, still
     * runs at once); at most max_delay_us; default 0. Added in 0.2.0.
     */
    int64_t min_delay_us;
    /*
     * Preferred batch sizes in rows (copied; 1..max_batch each; n_preferred at most
     * TS_BATCHER_MAX_PREFERRED): as soon as the queued requests, in order, add up to one of them,
     * a batch of the largest such size runs without waiting. Default none. Added in 0.2.0.
     */
    const int *preferred_batch;
    int n_preferred;
    /*
     * Priority levels (1..TS_BATCHER_MAX_PRIORITIES; default 1, and 0 means 1; a negative
     * value gives TS_EINVAL at ts_batcher_new). Level 0 is the most urgent: a
     * batch takes every queued request of level 0 before any of level 1, and so on; within a
     * level, arrival order. default_priority is the level of requests that name none
     * (ts_predict_options_t.priority < 0, and every ts_batcher_predict_async); default 0.
     * Added in 0.2.0.
     */
    int priority_levels;
    int default_priority;
    /*
     * Threads that help a replica hand out a large batch's answers (slicing the output and
     * calling the callbacks, which usually submit the requesters' next requests): with 0 (the
     * default) each replica answers its batches alone; with N, a batch of at least
     * TS_BATCHER_SPLIT_ANSWERS requests is cut into parts answered by the replica and up to N
     * helpers at once (shared by the replicas), so that a fast device does not wait for one
     * thread to call a thousand callbacks. Callbacks then also run on those helper threads.
     * A helper with nothing to answer looks again (yielding the core) for up to 50 us before
     * it sleeps. At most TS_BATCHER_MAX_ANSWER_THREADS. Added in 0.2.0.
     */
    int answer_threads;
    /*
     * With answer_threads > 0: a replica hands each finished batch's answers to the helpers
     * (cut into parts of at least TS_BATCHER_SPLIT_ANSWERS requests, at most one per helper; a
     * smaller batch is one part) and goes on to gather its next batch at once (by the batching
     * rule, which may still hold a partial batch for requesters being answered), answering
     * none itself; it waits only while the batch before the previous one is still being
     * answered (two batches in flight per replica: one computes while the one before it is
     * answered). This pays when more requests wait than one batch holds (more requesters than
     * max_batch, or several requests each): with exactly max_batch requesters the next batch
     * is made of this one's answered requesters and cannot start before they are answered. A
     * batch's answers then reach their callbacks on the helpers only (those of a failed
     * forward, or of a batch whose output could not be shared for lack of memory, on the
     * replica; timeouts and cancellations on the timer thread as always), and answers of
     * successive batches may reach them out of batch order. The replica's output time
     * (ts_batcher_replica_stats) is then the helpers' time answering its batches, summed over
     * the parts. While answers are being handed out, a replica that finds the queue empty
     * looks again (yielding the core) for up to 50 us before it sleeps. Needs answer_threads
     * >= 1 (else ts_batcher_new gives TS_EINVAL). Default 0 (off). Added in 0.7.0.
     */
    int overlap_answers;
} ts_batcher_options_t;

/* The most preferred batch sizes and priority levels a batcher takes. Added in 0.2.0. */
#define TS_BATCHER_MAX_PREFERRED  16
#define TS_BATCHER_MAX_PRIORITIES 16
/* answer_threads: at most this many helpers. Added in 0.2.0. */
#define TS_BATCHER_MAX_ANSWER_THREADS 64
/* requests; a batch's answers are split into parts of at least this many. Added in 0.2.0. */
#define TS_BATCHER_SPLIT_ANSWERS 64

/*
 * Fill opts with the defaults (no schema, no model). Added in 0.2.0. It replaces
 * ts_batcher_config_init.
 */
TS_EXTERN void ts_batcher_options_init(ts_batcher_options_t *opts);

/* ---------------------------------------------------------------------------------------------
 * The batcher Added in 0.1.0.
 */
typedef struct ts_batcher_s ts_batcher_t;

/*
 * Create the models (through opts->create, on this thread) and start the replica threads.
 * Returns 0 and *out, or TS_EINVAL (an option out of its range, a bad schema, placement or
 * timeout; the message names the field), TS_ENOTSUP (a cuda placement with no CUDA device),
 * TS_ENOMEM, or the model factory's error (TS_EMODEL when the factory returned a value that is
 * not a TS_E* code). ts_last_error() then tells why. Added in 0.1.0.
 */
TS_EXTERN int ts_batcher_new(ts_batcher_t **out, const ts_batcher_options_t *opts);

/*
 * Stop: serving and following end, pending requests complete with TS_ECANCELED, each replica
 * finishes (and answers) the batch it is running, the threads end and the models are freed.
 * Must not be called from a batcher callback, nor while another thread is still inside a call
 * on b. NULL is a no-op. Added in 0.1.0.
 */
TS_EXTERN void ts_batcher_free(ts_batcher_t *b);

/*
 * Number of replicas, and the device of replica i ("cpu", "cuda:1"; NULL when out of range).
 * Added in 0.1.0.
 */
TS_EXTERN int ts_batcher_replicas(const ts_batcher_t *b);
TS_EXTERN const char *ts_batcher_device(const ts_batcher_t *b, int i);

/*
 * Completion of a prediction, called exactly once, on a batcher thread (a replica's, an answer
 * helper's, the timer's, or the one in ts_batcher_free), never from inside
 * ts_batcher_predict_async. status is 0, or
 * TS_ESCHEMA, TS_EMODEL, TS_ETIMEDOUT, TS_ECANCELED, with its reason in ts_last_error(). On
 * success output holds exactly the request's rows (transferred: free it with ts_value_free) and
 * version is the weight version that computed it. Keep the callback short: it runs on the
 * thread that serves the next batch.
 *
 * The callback may submit the requester's next request (ts_batcher_predict_async, not the
 * blocking calls). A request submitted from a callback on a replica's thread wakes no other
 * replica: that
 * replica takes the queue again as soon as its batch's callbacks return, so a closed loop of
 * asynchronous requesters costs no thread wake-up per request (see docs/BATCHER.md).
 * Added in 0.1.0. Changed in 0.2.0: the message parameter is gone (use ts_last_error()).
 */
typedef void (*ts_predict_cb)(ts_batcher_t *b, int status, ts_value_t *output, int64_t version,
                              void *arg);

/*
 * Queue a request. input is a value tree matching the input schema, every tensor with the same
 * leading row count (1..max_batch). input is borrowed until the callback: the batcher takes no
 * copy and no reference, and a replica thread reads it later, so it must stay valid and
 * unchanged until the callback is called (or until ts_batcher_cancel returned 0 for the
 * request; a deadline, a cancellation and ts_batcher_free all end in the callback), unless
 * flags has TS_COPY (then it is copied now and may be freed as soon as this returns). When
 * this returns an error, input is not kept. timeout_ms is the
 * request's deadline: positive milliseconds, TS_TIMEOUT_DEFAULT for the options' timeout_ms, or
 * TS_TIMEOUT_INFINITE for none; 0 gives TS_EINVAL (a prediction cannot be answered without
 * waiting). A request that does not match the schema fails here with TS_ESCHEMA and the
 * callback is never called; TS_EAGAIN when the queue is full, TS_ECANCELED after shutdown
 * began. Added in 0.2.0. It replaces ts_batcher_submit.
 */
TS_EXTERN int ts_batcher_predict_async(ts_batcher_t *b, const ts_value_t *input, unsigned flags,
                                       int timeout_ms, ts_predict_cb cb, void *arg);

/*
 * The options of one request; fill with ts_predict_options_init, then change fields.
 * Added in 0.2.0.
 */
typedef struct ts_predict_options_s {
    unsigned flags; /* TS_COPY, as for ts_batcher_predict_async; default 0 */
    int timeout_ms; /* as for ts_batcher_predict_async; default TS_TIMEOUT_DEFAULT */
    int priority;   /* 0..priority_levels-1 (0 most urgent), or -1 (default) for default_priority */
} ts_predict_options_t;

/* Fill opts with the defaults. Added in 0.2.0. */
TS_EXTERN void ts_predict_options_init(ts_predict_options_t *opts);

/*
 * ts_batcher_predict_async with options (NULL: the defaults) and the request's id in *id (may be
 * NULL; unique within the batcher, never 0) for ts_batcher_cancel. Same errors, and TS_EINVAL
 * for a priority past the batcher's levels. The bounded queue (opts.max_queued) answers at once:
 * a request that finds it full fails here with TS_EAGAIN and the callback is never called.
 * Added in 0.2.0.
 */
TS_EXTERN int ts_batcher_predict_async_with(ts_batcher_t *b, const ts_value_t *input,
                                            const ts_predict_options_t *opts, ts_predict_cb cb,
                                            void *arg, uint64_t *id);

/*
 * Cancel a queued request: 0 when it was still queued (its callback then gets TS_ECANCELED, on
 * the batcher's timer thread, never inside this call); TS_ENOENT when it is not queued (already
 * in a batch, answered, or unknown; a request in a forward gets that forward's answer). Costs a
 * walk of the queue. Added in 0.2.0.
 */
TS_EXTERN int ts_batcher_cancel(ts_batcher_t *b, uint64_t id);

/*
 * Blocking prediction: input is borrowed for the call; on success *output (yours) holds the
 * request's rows and *version (may be NULL) the weight version. timeout_ms as for
 * ts_batcher_predict_async. Returns the status the callback would get. Must not be called from
 * a batcher callback. Added in 0.1.0.
 */
TS_EXTERN int ts_batcher_predict(ts_batcher_t *b, const ts_value_t *input, int timeout_ms,
                                 ts_value_t **output, int64_t *version);

/* ---------------------------------------------------------------------------------------------
 * Weight updates. Every replica loads new weights between two forwards, never during one, and
 * every answer carries the version it was computed with.
 */

/*
 * Called once the batcher no longer reads params (on a batcher thread or the caller's).
 * Added in 0.1.0.
 */
typedef void (*ts_weights_release_cb)(const ts_value_t *params, void *arg);

/*
 * Publish new weights without waiting. params (a state dict) is retained until release (may be
 * NULL) is called: after every replica has loaded it, or a newer update replaced it, or the
 * batcher is freed. Replicas that fail to load it keep their previous weights and version.
 * Added in 0.2.0. It replaces ts_batcher_set_weights.
 */
TS_EXTERN int ts_batcher_load_weights_async(ts_batcher_t *b, const ts_value_t *params,
                                            int64_t version, ts_weights_release_cb release,
                                            void *arg);

/*
 * Publish new weights and wait until every replica has loaded them (params borrowed for the
 * call). timeout_ms: positive milliseconds, TS_TIMEOUT_DEFAULT for the options' timeout_ms, or
 * TS_TIMEOUT_INFINITE; 0 gives TS_EINVAL (loading cannot finish without waiting). Returns 0,
 * the first load error of a replica (its message in ts_last_error()), or TS_ETIMEDOUT; on
 * timeout the update is withdrawn from the replicas that had not started loading it.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_batcher_load_weights(ts_batcher_t *b, const ts_value_t *params, int64_t version,
                                      int timeout_ms);

/*
 * The weight version of each replica is reported here: the smallest and the largest.
 * Added in 0.1.0.
 */
TS_EXTERN void ts_batcher_versions(ts_batcher_t *b, int64_t *min_version, int64_t *max_version);

/* Counters since creation. Added in 0.1.0. */
typedef struct ts_batcher_stats_s {
    uint64_t requests;     /* answered with status 0 */
    uint64_t failed;       /* answered with an error (schema errors at submit excluded) */
    uint64_t batches;      /* forwards run */
    uint64_t rows;         /* rows in those forwards */
    uint64_t full_batches; /* forwards that had max_batch rows */
    uint64_t weight_loads; /* successful weight loads, over all replicas */
    uint32_t queued;       /* requests waiting now */
    uint32_t max_batch;
    /*
     * Records taken from NAME/requests by ts_batcher_serve that were not requests (not a map,
     * no integer id, no reply bin name, no input, or an input that does not match the schema);
     * the empty map a stopping server appends to wake the others is not counted. Added in 0.2.0.
     */
    uint64_t malformed;
    /*
     * Requests accepted (at submit, before any answer). Every accepted request is answered once:
     * submitted = requests + failed + queued + those in a running batch. Added in 0.2.0.
     */
    uint64_t submitted;
    uint64_t timed_out; /* of failed: deadline passed while queued. Added in 0.2.0. */
    uint64_t cancelled; /* of failed: ts_batcher_cancel or shutdown. Added in 0.2.0. */
    uint64_t rejected;  /* refused at submit because the queue was full. Added in 0.2.0. */
} ts_batcher_stats_t;

/* Copy the counters into *out, a consistent snapshot. Added in 0.1.0. */
TS_EXTERN void ts_batcher_stats(ts_batcher_t *b, ts_batcher_stats_t *out);

/* Buckets of the batch-size histogram: 1, 2, 3-4, 5-8, ..., 32769-65536 rows. Added in 0.2.0. */
#define TS_BATCHER_HIST_BUCKETS 17

/*
 * One replica's counters since creation (Triton's split of a request's time). Times are sums in
 * nanoseconds; divide by the counts for means. Added in 0.2.0.
 */
typedef struct ts_batcher_replica_stats_s {
    uint64_t batches;  /* forwards run */
    uint64_t rows;     /* rows in them */
    uint64_t requests; /* requests in them (answered or failed by the forward) */
    uint64_t queue_ns; /* over those requests: from submit until a batch took the request */
    /* over batches: copying the requests' rows into the batch buffer (the input copy) */
    uint64_t input_ns;
    /*
     * over batches: the model's forward and the output check; for a libtorch model on a GPU
     * this includes its own copies to and from the device
     */
    uint64_t compute_ns;
    uint64_t output_ns; /* over batches: slicing the output and calling the callbacks */
    /* batches by size: bucket 0 has 1 row, bucket k (k >= 1) 2^(k-1)+1 to 2^k rows */
    uint64_t batch_sizes[TS_BATCHER_HIST_BUCKETS];
} ts_batcher_replica_stats_t;

/*
 * Copy replica i's counters into *out (a consistent snapshot). 0, or TS_EINVAL when i is out
 * of range. Added in 0.2.0.
 */
TS_EXTERN int ts_batcher_replica_stats(ts_batcher_t *b, int i, ts_batcher_replica_stats_t *out);

/* ---------------------------------------------------------------------------------------------
 * Remote use through tensord
 *
 * The service NAME (tensorshare/service.h), for a served model called NAME: each remote
 * prediction is one call, its request {input: <input tree>} (other keys ignored), its answer
 * {status: 0, version: int, output: <tree>}, or {status: TS_E* (TS_ESCHEMA, TS_EMODEL,
 * TS_ETIMEDOUT, TS_ECANCELED, ...), version: int, error: string} for a failed prediction (the
 * protocol's statuses cannot carry those codes; only an answer that cannot be built is failed
 * with ts_call_fail, TS_ENOMEM). Added in 0.6.0.
 *
 * The relay through bins, kept for predictors that use it (TS_PREDICTOR_RELAY, and those before
 * 0.6.0):
 *   NAME/requests  requests, appended by remote predictors: a record
 *                  {id: int, reply: string (the predictor's reply bin), timeout_ms: int,
 *                   input: <input tree>}
 *   reply bins     one per predictor (NAME/reply/<unique>), answers appended by the server:
 *                  {id: int, status: int (0 or TS_E*), version: int, output: <tree> (status 0),
 *                   error: string (status != 0)}
 * Parameters (ts_batcher_follow_weights): a bin whose last item is {params: <state dict>,
 * version: int}, as an RL trainer publishes it with ts_put. Added in 0.1.0.
 */
#define TS_BATCHER_REQ_SUFFIX "/requests"

/*
 * Serve the batcher on tensord under name. It registers the service name on client (a blocking
 * call; the client registers again by itself after a reconnection) with the options'
 * service_concurrency: each call is handed to this function's callback on the client's I/O
 * thread, submitted to the batcher at once (its input borrowed from the call's record) with the
 * time the caller had left as its deadline, and answered with ts_call_reply by the thread that
 * completes the prediction. Against a tensord without services (TS_EUNKNOWNOP) only the relay
 * serves. It also serves the relay: requests are taken from NAME/requests in groups (GET with
 * max_items, WAIT between, chained on the client's I/O thread; a thread restarts the chain when
 * the connection comes back), submitted, and each answer is appended to its requester's reply
 * bin. client is borrowed and must outlive the batcher (or ts_batcher_stop_remote). Malformed
 * requests (see ts_batcher_stats_t.malformed) are counted and answered with TS_ESCHEMA (relayed
 * ones only when they name an id and a reply bin; the others are dropped). One name per batcher;
 * TS_EINVAL when already serving or for a bad service_concurrency; the error of
 * ts_service_register. Added in 0.1.0. Changed in 0.2.0: malformed requests are counted and
 * answered. Changed in 0.6.0: it serves the service name too.
 */
TS_EXTERN int ts_batcher_serve(ts_batcher_t *b, ts_client_t *client, const char *name);

/*
 * A malformed request was taken from NAME/requests or called through the service NAME (see
 * ts_batcher_stats_t.malformed). status is TS_ESCHEMA; ts_last_error() says what was wrong ("not
 * a map", "request 5: no 'input'", "call 7: not a map with an 'input'", "call 7: <schema
 * message>"). The batcher has already counted it and answered it with TS_ESCHEMA and that reason
 * (a relayed one only when it named an id and a reply bin); it logs nothing itself. Called on the
 * serving client's I/O thread, one call at a time; keep it short (no requests are taken meanwhile),
 * make no blocking calls on that client from it (they fail with TS_EDEADLK), and do not call
 * ts_batcher_stop_remote or ts_batcher_free from it. Added in 0.2.0. Changed in 0.2.0: it was
 * called on the serve thread.
 */
typedef void (*ts_batcher_malformed_cb)(ts_batcher_t *b, int status, void *arg);

/*
 * The serving options; fill with ts_batcher_serve_options_init, then change fields.
 * Added in 0.2.0.
 */
typedef struct ts_batcher_serve_options_s {
    ts_batcher_malformed_cb on_malformed; /* may be NULL (the default): only counted */
    void *on_malformed_arg;               /* passed to on_malformed; never read by the batcher */
    /*
     * Calls of the service NAME that tensord hands this server before it has answered them
     * (ts_service_options_t.concurrency): 0 (the default) for TS_BATCHER_SERVICE_BATCHES x
     * max_batch x replicas, at least TS_BATCHER_SERVICE_MIN_CONCURRENCY; at most
     * TS_SERVICE_MAX_CONCURRENCY. Calls past it wait in tensord, where another server of the
     * same name may take them. Added in 0.6.0.
     */
    int service_concurrency;
} ts_batcher_serve_options_t;

/* The default service concurrency, in batches of max_batch rows per replica. Added in 0.6.0. */
#define TS_BATCHER_SERVICE_BATCHES 4
/* calls; the default service concurrency is at least this. Added in 0.6.0. */
#define TS_BATCHER_SERVICE_MIN_CONCURRENCY 64

/* Fill opts with the defaults (no callback). Added in 0.2.0. */
TS_EXTERN void ts_batcher_serve_options_init(ts_batcher_serve_options_t *opts);

/*
 * ts_batcher_serve with options (copied; NULL for the defaults): ts_batcher_serve(b, client,
 * name) is ts_batcher_serve_with(b, client, name, NULL). Same errors. Added in 0.2.0.
 */
TS_EXTERN int ts_batcher_serve_with(ts_batcher_t *b, ts_client_t *client, const char *name,
                                    const ts_batcher_serve_options_t *opts);

/*
 * Follow a parameters bin: a thread waits for new items in bin and publishes each new
 * {params, version} to the replicas (as ts_batcher_load_weights_async). client as for serve.
 * Nothing reports an update that a replica does not load (it keeps its weights and version;
 * ts_batcher_stats_t.weight_loads counts only the loads that succeeded), nor an item that is
 * not {params, version} (skipped): to learn of them, load each item with ts_batcher_load_weights
 * on a thread of your own, as tsinfer does. Added in 0.1.0.
 */
TS_EXTERN int ts_batcher_follow_weights(ts_batcher_t *b, ts_client_t *client, const char *bin);

/*
 * Stop serving and following. The service is unregistered (blocking until tensord confirms, at
 * most the client's request timeout; at once while the client is not connected), its calls
 * still queued in the batcher are cancelled (their callers get TS_ECANCELED) and the answers of
 * those in a forward now are waited for. The relay's taking chain is waited for while the client
 * is connected (about a wait period, 2 s at most); a call of it that waits for a reconnection is
 * left to end by itself (at the reconnection, at its deadline, or when the client is freed), and
 * takes nothing for the batcher then. The follow thread is waited for: about a wait period, or
 * while the connection is down, until the reconnection or its wait's deadline (up to the request
 * timeout). Once this returns, nothing makes a new call on the client (that chain call and the
 * relay's wake-up, an append not waited for, may still be in flight): it may be freed.
 * Added in 0.1.0. Changed in 0.6.0: the service. Changed in 0.7.2: quick while tensord is down.
 */
TS_EXTERN void ts_batcher_stop_remote(ts_batcher_t *b);

/* ---------------------------------------------------------------------------------------------
 * Same-host serving through shared memory. Added in 0.3.0.
 *
 * A serving process can also offer shared-memory slots to requesters on its own host: one slot
 * per requester, with a request area (the requester writes its input tensors there), an answer
 * area (the server writes the output there), sequence numbers and futex wake-ups both ways. The
 * server creates a POSIX shared-memory object (/dev/shm, mode 0600, a random name) and
 * advertises it with a small record in the bin NAME/shm of the tensord it serves through:
 * {path, token, pid, boot_id, slots, request_bytes, answer_bytes}. A predictor opened on NAME
 * reads that record at open and uses the slots when its host's boot id is the same and it can
 * open the object and find the same token in it (so it is on the same host, in the same /dev/shm
 * and allowed to); otherwise, and whenever a slot cannot be used, it calls the service NAME
 * (see ts_predictor_open_with). docs/BATCHER.md ("Same host: shared-memory slots") has the
 * protocol.
 */
#define TS_BATCHER_SHM_SUFFIX        "/shm" /* the descriptor bin: NAME/shm. Added in 0.3.0. */
#define TS_BATCHER_SHM_DEFAULT_SLOTS 64     /* slots, when the options name none. Added in 0.3.0. */
/* slots per serving process at most: the serving thread scans them all. Added in 0.3.0. */
#define TS_BATCHER_SHM_MAX_SLOTS 1024
/* bytes; one request or answer area at most (64 MiB). Added in 0.3.0. */
#define TS_BATCHER_SHM_MAX_AREA ((size_t)64 << 20)

/* The same-host options; fill with ts_batcher_shm_options_init. Added in 0.3.0. */
typedef struct ts_batcher_shm_options_s {
    /* requesters served through slots at once (1..TS_BATCHER_SHM_MAX_SLOTS); default 64 */
    int slots;
    /*
     * Bytes of each slot's request and answer areas (0: the default; at most
     * TS_BATCHER_SHM_MAX_AREA), each rounded up to a multiple of 4096 (a page; the descriptor
     * record in NAME/shm gives the rounded sizes). The default request area holds a request of
     * max_batch rows of the input schema; the default answer area holds max_batch rows of the
     * output schema, or, without one, as much as the request area and at least 64 KiB. An input
     * that does not fit goes through the service NAME instead (ts_predictor_stats_t.oversize); an
     * answer that does not fit is answered TS_EMSGSIZE.
     */
    size_t request_bytes;
    size_t answer_bytes;
} ts_batcher_shm_options_t;

/* Fill opts with the defaults. Added in 0.3.0. */
TS_EXTERN void ts_batcher_shm_options_init(ts_batcher_shm_options_t *opts);

/*
 * Offer shared-memory slots to same-host predictors of name (opts copied; NULL for the
 * defaults). Creates the shared-memory object, starts one thread that takes requests from the
 * slots and submits them (answers are written into the slots by the threads that answer them),
 * and puts the descriptor record into NAME/shm through client (a blocking call, on this thread).
 * Use it beside ts_batcher_serve with the same client and name: predictors on other hosts, or
 * that find no free slot, call the service NAME that ts_batcher_serve serves. A requester that
 * dies mid-request never blocks the server: its slot is taken over by the next predictor that
 * finds its owner dead (the answer to its last request is discarded). ts_batcher_stop_remote
 * and ts_batcher_free close the slots (a request the server had taken still gets its answer, or
 * TS_ECANCELED from ts_batcher_free; one it had not taken goes through the service in the same
 * call, and the predictors call the service from then on), delete NAME/shm and remove the
 * object's name. Returns 0; TS_EINVAL (bad
 * arguments or options, already offering slots, or another client than serve's); TS_ENOMEM;
 * the error of shm_open, mmap or ts_put (ts_last_error() says which). Added in 0.3.0.
 */
TS_EXTERN int ts_batcher_serve_shm(ts_batcher_t *b, ts_client_t *client, const char *name,
                                   const ts_batcher_shm_options_t *opts);

/* The remote side: a predictor talks to a served batcher through a tensord. Added in 0.1.0. */
typedef struct ts_predictor_s ts_predictor_t;

/*
 * Open a predictor for the model served as name (ts_predictor_open_with with the defaults:
 * TS_PREDICTOR_AUTO). client is borrowed and must outlive the predictor. It owns one thread,
 * which fails predictions at their deadlines while the connection is down; with the relay it
 * also owns a reply bin (deleted when the predictor is freed), and its thread restarts the
 * receiving of answers (done on the client's I/O thread) when the connection comes back.
 * Added in 0.1.0. Changed in 0.6.0: predictions go through the service NAME.
 */
TS_EXTERN int ts_predictor_open(ts_predictor_t **out, ts_client_t *client, const char *name);
/* How a predictor reaches its server (ts_predictor_options_t.transport). Added in 0.3.0. */
typedef enum ts_predictor_transport_e {
    /*
     * shared-memory slots when the server advertises them on this host, else the service NAME
     * (Changed in 0.6.0: else the relay before)
     */
    TS_PREDICTOR_AUTO = 0,
    /* always through the bins on tensord (servers before 0.6.0 serve only this) */
    TS_PREDICTOR_RELAY = 1,
    /* slots or fail: ts_predictor_open_with gives TS_ENOTSUP when no slot can be had */
    TS_PREDICTOR_SHM = 2,
    TS_PREDICTOR_SERVICE = 3 /* always calls of the service NAME. Added in 0.6.0. */
} ts_predictor_transport_t;

/* The predictor's options; fill with ts_predictor_options_init. Added in 0.3.0. */
typedef struct ts_predictor_options_s {
    int transport; /* a ts_predictor_transport_t; default TS_PREDICTOR_AUTO */
} ts_predictor_options_t;

/* Fill opts with the defaults. Added in 0.3.0. */
TS_EXTERN void ts_predictor_options_init(ts_predictor_options_t *opts);

/*
 * ts_predictor_open with options (NULL: the defaults; ts_predictor_open is this with NULL).
 * With TS_PREDICTOR_AUTO (and TS_PREDICTOR_SHM), the predictor reads NAME/shm once, here (a
 * blocking call on client), and when the server advertises slots on this host it takes one:
 * its blocking ts_predictor_predict calls then go through the slot, one at a time (a second
 * thread calling at once, an input larger than the request area, and every
 * ts_predictor_predict_async go through the service). When the slot's server stops or dies,
 * the request in the slot gets its answer, or TS_ECONNRESET when the server died after taking
 * it (within about TS_PREDICTOR_SHM_CHECK_MS; one it had not taken goes through the service),
 * or TS_ETIMEDOUT at its deadline, and the predictor calls the service from then on. Slots
 * whose server already stopped or died are not taken. Predictions through the service are
 * ts_call_async calls of NAME with TS_CALL_WAIT (a request made while no server serves NAME
 * waits in tensord for one, up to its deadline). Same errors as ts_predictor_open: TS_EINVAL
 * (bad arguments or transport), TS_ENOMEM, and TS_ENOTSUP for TS_PREDICTOR_SHM without a usable
 * slot. Added in 0.3.0. Changed in 0.6.0: the service instead of the relay.
 */
TS_EXTERN int ts_predictor_open_with(ts_predictor_t **out, ts_client_t *client, const char *name,
                                     const ts_predictor_options_t *opts);

/* ms; a predictor waiting in a slot checks this often that its server lives. Added in 0.3.0. */
#define TS_PREDICTOR_SHM_CHECK_MS 20

/* A predictor's counters. Added in 0.3.0. */
typedef struct ts_predictor_stats_s {
    uint64_t shm;     /* requests sent through the shared-memory slot */
    uint64_t relayed; /* requests sent through the bins */
    /* of relayed and service: inputs larger than the slot's request area */
    uint64_t oversize;
    /*
     * TS_PREDICTOR_SHM while it holds a usable slot, else TS_PREDICTOR_RELAY when opened so,
     * else TS_PREDICTOR_SERVICE (Changed in 0.6.0)
     */
    int transport;
    uint64_t reclaimed; /* 1 when its slot was taken over from a requester that died */
    uint64_t service;   /* requests sent as calls of the service. Added in 0.6.0. */
} ts_predictor_stats_t;

/* Copy p's counters into *out. Thread-safe. Added in 0.3.0. */
TS_EXTERN void ts_predictor_stats(ts_predictor_t *p, ts_predictor_stats_t *out);

/*
 * Outstanding requests complete with TS_ECANCELED before this returns; the reply bin (relay) is
 * deleted. A call of the service cannot be withdrawn from tensord: its answer, if one comes, is
 * dropped without touching the freed predictor. Must not be called from a predictor callback.
 * NULL is a no-op. Added in 0.1.0.
 */
TS_EXTERN void ts_predictor_free(ts_predictor_t *p);

/*
 * Completion of a remote prediction, called exactly once, never from inside the call that
 * queued it: on the client's I/O thread (answers, deadlines, and a request that could not be
 * sent; so blocking calls on that client fail there with TS_EDEADLK, as in any client
 * callback), on the predictor's thread (deadlines while the connection is down), or in
 * ts_predictor_free (TS_ECANCELED). Same meaning as ts_predict_cb (a failure's reason in
 * ts_last_error()); output is transferred. Blocking predictor calls made from it fail with
 * TS_EDEADLK. Keep it short: the client's other replies wait for it. Added in 0.2.0. It
 * replaces ts_remote_cb, which also had a message parameter. Changed in 0.2.0: answers come on
 * the client's I/O thread (they came on the predictor's thread).
 */
typedef void (*ts_predictor_cb)(ts_predictor_t *p, int status, ts_value_t *output, int64_t version,
                                void *arg);

/*
 * ms; what TS_TIMEOUT_DEFAULT means for a predictor: the client's default request timeout
 * Added in 0.1.0.
 */
#define TS_PREDICTOR_DEFAULT_TIMEOUT_MS 30000 /* Added in 0.2.0. */

/*
 * Send a request (input borrowed for the call: it is encoded and sent before this returns).
 * timeout_ms: positive milliseconds, TS_TIMEOUT_DEFAULT for TS_PREDICTOR_DEFAULT_TIMEOUT_MS, or
 * TS_TIMEOUT_INFINITE for none (through the service: the longest call tensord accepts, 24
 * hours); 0 gives TS_EINVAL. The callback gets TS_ETIMEDOUT when no answer came in time, and
 * TS_ESERVICE when the serving process holding the call died or lost its connection; the
 * server also drops the request if it is still queued there when the time is up (measured from
 * when the server took it). Any number may be outstanding (through the service at most the
 * serving tensord's --max-watch per connection: TS_ETOOMANY). Errors here: TS_EINVAL,
 * TS_ENOMEM, and the client's (ts_call_async's or ts_append_async's).
 * Added in 0.2.0. It replaces ts_predictor_submit. Changed in 0.6.0: TS_ESERVICE.
 */
TS_EXTERN int ts_predictor_predict_async(ts_predictor_t *p, const ts_value_t *input, int timeout_ms,
                                         ts_predictor_cb cb, void *arg);
/* Blocking form; *output is yours, *version may be NULL. Added in 0.1.0. */
TS_EXTERN int ts_predictor_predict(ts_predictor_t *p, const ts_value_t *input, int timeout_ms,
                                   ts_value_t **output, int64_t *version);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_BATCHER_H */
