/*
 * tensorshare RL helpers: a trainer that publishes network parameters and collects experience,
 * and workers that act on the newest parameters and send experience back.
 *
 * Both sit on the public client API only (tensorshare.h). They share two bins on one tensord:
 * - the parameters bin (default "parameters") holds one item, {params: <record>, version: int};
 * - the data bin (default "data") holds experience items, each {data: <record>, version: int},
 *   where version is the parameter version the worker used to produce the data.
 * The record layout matches the original Python RLTrainer/RLWorker, so mixed setups can share a
 * daemon as long as both speak the tensorshare protocol.
 *
 * Versions start at 0 and only grow. A trainer that starts reads the parameters bin and resumes
 * after the version it finds there, so a restarted trainer does not start again at 0. A worker
 * never goes back to an older version: a publish older than the one it holds is ignored.
 *
 * Lifetimes: a trainer or worker borrows its ts_client_t, which must outlive it (free the
 * trainer or worker first). A worker subscribes to the parameters bin on its client, so the
 * same client must not listen to that bin for anything else.
 *
 * Threads: every function here may be called from any application thread; a trainer or a worker
 * may be shared by several threads. Blocking functions must not be called from client callbacks
 * (nor from the worker's event callback): they return TS_EDEADLK there.
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success, borrowed pointer parameters,
 * _free(NULL) is a no-op, and timeouts as described there (TS_TIMEOUT_DEFAULT is the options'
 * timeout_ms).
 */
#ifndef TENSORSHARE_RL_H
#define TENSORSHARE_RL_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/replay.h"
#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* staleness_tolerance value that keeps every item, however old its parameters. Added in 0.1.0. */
#define TS_RL_NO_FILTER (-1)

/* Flag for ts_rl_worker_add: fail with TS_EAGAIN instead of waiting for room. Added in 0.1.0. */
#define TS_RL_NONBLOCK 0x100u

/* The trainer and the worker (opaque). Added in 0.1.0. */
typedef struct ts_rl_trainer_s ts_rl_trainer_t;
typedef struct ts_rl_worker_s ts_rl_worker_t;

/* What a worker's event callback reports. Added in 0.1.0. */
typedef enum ts_rl_event_e {
    TS_RL_EV_PARAMS = 1,        /* newer parameters arrived; version is theirs */
    TS_RL_EV_DISCONNECTED = 2,  /* the connection to tensord was lost; workers keep the last
                                   parameters; adds in flight fail (TS_RL_EV_ADD_FAILED), and
                                   adds made meanwhile wait for the reconnection and are sent
                                   then (one that waits longer than the client's request
                                   timeout fails with TS_ETIMEDOUT) */
    TS_RL_EV_RESUBSCRIBED = 3,  /* connected and listening again; the parameters are re-read */
    TS_RL_EV_ADD_FAILED = 4,    /* an experience item was not stored; status says why */
    TS_RL_EV_PARAMS_FAILED = 5, /* reading the parameters bin failed; status says why */
    TS_RL_EV_PARAMS_BAD = 6     /* the parameters bin holds something that is not
                                   {params, version}; it was ignored */
} ts_rl_event_t;

/*
 * A worker's event callback. Runs on the client's I/O thread (TS_RL_EV_PARAMS also on the thread
 * in ts_rl_worker_new), possibly with a worker lock held: it must return quickly, must not block
 * and must not free the worker. status is 0 or a TS_E* code (its reason in ts_last_error());
 * version is the parameter version the event concerns (-1 when none). Added in 0.1.0.
 * Changed in 0.2.0: status comes before event.
 */
typedef void (*ts_rl_event_cb)(ts_rl_worker_t *w, int status, ts_rl_event_t event, int64_t version,
                               void *arg);

/*
 * Options of the trainer and the worker; fill with ts_rl_options_init, then change fields.
 * Added in 0.1.0.
 */
typedef struct ts_rl_options_s {
    /*
     * Bin names. prefix (may be NULL) is prepended to both, so several experiments can share a
     * daemon ("exp1/" gives "exp1/parameters" and "exp1/data"). All strings are copied; a
     * resulting name longer than TS_MAX_NAME_LEN (255) bytes gives TS_ENAMETOOLONG.
     */
    const char *prefix;     /* default NULL */
    const char *params_bin; /* default "parameters" */
    const char *data_bin;   /* default "data" */

    /*
     * Trainer: keep an experience item only when its version is at least the newest published
     * version minus this many versions (ElasticDL's staleness tolerance). 0 keeps only items
     * made with the newest parameters (the original's filter_version=True); TS_RL_NO_FILTER
     * keeps everything. Before the first publish every item is kept. Default 0.
     */
    int staleness_tolerance;

    /*
     * Worker: experience adds in flight at once, in items and encoded bytes (an item larger
     * than max_in_flight_bytes still goes when nothing else is in flight). A full worker makes
     * ts_rl_worker_add wait, which bounds memory and pushes back on a producer that outruns
     * the daemon. Defaults 16 items, 64 MiB.
     */
    unsigned max_in_flight;
    size_t max_in_flight_bytes;
    /*
     * What TS_TIMEOUT_DEFAULT means for the trainer's and worker's calls, and the longest wait
     * for room in ts_rl_worker_add and for the adds in flight in ts_rl_worker_free: positive
     * milliseconds, 0 (do not wait) or TS_TIMEOUT_INFINITE; default 30000. Added in 0.2.0. It
     * replaces add_timeout_ms.
     */
    int timeout_ms;

    ts_rl_event_cb on_event; /* worker: optional */
    void *event_arg;         /* passed to on_event; never read by the library */

    /*
     * Experience through a replay table (tensorshare/replay.h) instead of a plain bin: when
     * replay is not NULL (borrowed during ts_rl_trainer_new only), the data bin is a table with
     * these settings, which the trainer creates when it is missing. Workers then insert each
     * item with replay_priority (default 1), blocking while the table's rate limiter holds
     * inserts back (up to timeout_ms; TS_RL_NONBLOCK: not at all, TS_ETIMEDOUT); and collect
     * draws up to max_items (1..TS_TABLE_SAMPLE_MAX; 0 = 1) by the table's sampler instead of
     * taking items, so an item can be collected again (ts_rl_batch_key names it for
     * ts_table_update). The staleness tolerance applies as for a bin. Added in 0.4.0.
     */
    const ts_table_config_t *replay;
    double replay_priority;
} ts_rl_options_t;

/* Fill opts with the defaults. Added in 0.1.0. */
TS_EXTERN void ts_rl_options_init(ts_rl_options_t *opts);

/* ---------------------------------------------------------------------------------------------
 * Trainer
 */

/*
 * Create a trainer on client c (borrowed; it must outlive the trainer). opts may be NULL for
 * the defaults. Reads the parameters bin once: when it holds a published version, the trainer
 * resumes after it; otherwise its first publish is version 0. Fails with the client's errors,
 * or TS_EBADRECORD when the parameters bin holds something other than {params, version}.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_rl_trainer_new(ts_rl_trainer_t **out, ts_client_t *c, const ts_rl_options_t *opts);
TS_EXTERN void ts_rl_trainer_free(ts_rl_trainer_t *t);

/*
 * Publish parameters as the next version and wait until tensord holds them. params (borrowed)
 * is typically a map of named tensors; its tensor memory is read during the call only, never
 * copied first. On success *version (may be NULL) receives the published version. A failed
 * publish still uses up its version number, so a version is never given to two different
 * parameter sets. Added in 0.1.0.
 */
TS_EXTERN int ts_rl_trainer_publish(ts_rl_trainer_t *t, const ts_value_t *params, int64_t *version);

/* The newest version this trainer published or resumed from, -1 when none. Added in 0.1.0. */
TS_EXTERN int64_t ts_rl_trainer_version(ts_rl_trainer_t *t);

/* Experience taken from the data bin by one collect call. Added in 0.1.0. */
typedef struct ts_rl_batch_s ts_rl_batch_t;

/*
 * Take the experience workers added: at most max_items items (0 = all there are), oldest first,
 * removing them from the data bin. Items older than the staleness tolerance allows, and items
 * that are not {data, version}, are dropped and counted (ts_rl_trainer_stats).
 * When nothing is kept, waits for new items up to timeout_ms (0: do not wait;
 * TS_TIMEOUT_DEFAULT: the options' timeout_ms; TS_TIMEOUT_INFINITE: no limit), woken by the
 * daemon (no polling). Returns 0 with at least one item in *out (yours to free), or
 * TS_ETIMEDOUT when no item was kept in time ("no experience kept in 'BIN' within the
 * timeout"), or a client error (for instance TS_ECONNRESET while the daemon restarts; calling
 * again after the client reconnected works). The call returns within timeout_ms plus one
 * request timeout of the client (ts_client_options_t.request_timeout_ms): it makes a request
 * only before timeout_ms has passed, except its first get (so 0 still asks once, and waits up to
 * the request timeout for the answer) and the gets that go on taking items already in the bin
 * after everything taken was dropped; and a request tensord does not answer in time (stopped,
 * paused, or the connection down) ends the call at once with that request's TS_ETIMEDOUT and
 * message ("no reply within the request timeout", ...; ts_last_error_no_reply() says 1). Items a
 * get took are never given up for time: a get's reply is awaited for the request timeout.
 * Added in 0.1.0. Changed in 0.7.2: a request tensord does not answer ends the call.
 */
TS_EXTERN int ts_rl_trainer_collect(ts_rl_trainer_t *t, size_t max_items, int timeout_ms,
                                    ts_rl_batch_t **out);

/* Items in a batch (at least 1). Added in 0.1.0. */
TS_EXTERN size_t ts_rl_batch_count(const ts_rl_batch_t *b);
/*
 * The i-th item's data record, valid until ts_rl_batch_free; NULL when out of range.
 * Added in 0.1.0.
 */
TS_EXTERN const ts_value_t *ts_rl_batch_data(const ts_rl_batch_t *b, size_t i);
/*
 * The parameter version the i-th item was produced with (-1: before any), or -1 out of range.
 * Added in 0.1.0.
 */
TS_EXTERN int64_t ts_rl_batch_version(const ts_rl_batch_t *b, size_t i);
/* Items this collect call dropped (stale or malformed) on its way to the batch. Added in 0.1.0. */
TS_EXTERN size_t ts_rl_batch_dropped(const ts_rl_batch_t *b);
/* Item i's key in the replay table it was drawn from (options' replay), else 0. Added in 0.4.0. */
TS_EXTERN uint64_t ts_rl_batch_key(const ts_rl_batch_t *b, size_t i);
TS_EXTERN void ts_rl_batch_free(ts_rl_batch_t *b);

/* A trainer's counters (ts_rl_trainer_stats). Added in 0.1.0. */
typedef struct ts_rl_trainer_stats_s {
    int64_t version;            /* newest published (or resumed from) version, -1 when none */
    int64_t resumed_from;       /* version found in the parameters bin at start, -1 when none */
    int64_t newest_seen;        /* highest version tag seen on experience, -1 when none */
    uint64_t published;         /* successful publishes */
    uint64_t publish_failed;    /* failed publishes */
    uint64_t received;          /* items handed out in batches */
    uint64_t dropped_stale;     /* items dropped by the staleness filter */
    uint64_t dropped_malformed; /* items that were not {data, version} */
} ts_rl_trainer_stats_t;

/* A consistent snapshot of the trainer's counters. Added in 0.1.0. */
TS_EXTERN void ts_rl_trainer_stats(ts_rl_trainer_t *t, ts_rl_trainer_stats_t *out);

/* ---------------------------------------------------------------------------------------------
 * Worker
 */

/* A refcounted, read-only snapshot of published parameters. Added in 0.1.0. */
typedef struct ts_rl_params_s ts_rl_params_t;

/* The parameters record as published (typically a map of named tensors). Added in 0.1.0. */
TS_EXTERN const ts_value_t *ts_rl_params_value(const ts_rl_params_t *p);
TS_EXTERN int64_t ts_rl_params_version(const ts_rl_params_t *p);
/* Take one more reference (for another thread); returns p. Added in 0.1.0. */
TS_EXTERN ts_rl_params_t *ts_rl_params_retain(ts_rl_params_t *p);
/*
 * Drop a reference; the last one frees the snapshot. NULL is a no-op. Any thread.
 * Added in 0.1.0.
 */
TS_EXTERN void ts_rl_params_release(ts_rl_params_t *p);

/*
 * Create a worker on client c (borrowed; it must outlive the worker). opts may be NULL for the
 * defaults. Subscribes to the parameters bin and reads it once, so parameters published before
 * the call are available when it returns. From then on the worker keeps the newest parameters
 * locally: a publish triggers one read, a burst of publishes is read once, an older version is
 * ignored, and after a reconnect the bin is read again. Added in 0.1.0.
 */
TS_EXTERN int ts_rl_worker_new(ts_rl_worker_t **out, ts_client_t *c, const ts_rl_options_t *opts);

/*
 * Waits for the adds in flight up to the options' timeout_ms (0: not at all), ends the
 * subscription and frees the worker; on_event is not called once it returns (it waits for a
 * call running meanwhile). Requests still in flight then (adds, a read of the parameters bin)
 * are answered later on the client's I/O thread, at the latest with TS_ECANCELED while the
 * client is freed; they report nothing and keep what they need of the worker alive until
 * then. The data of TS_BORROW adds still in flight must therefore stay valid until those
 * answers: until ts_client_free returns when in doubt. Parameter snapshots handed out stay
 * valid until released. Must not be called from a client or event callback. NULL is a no-op.
 * Added in 0.1.0.
 */
TS_EXTERN void ts_rl_worker_free(ts_rl_worker_t *w);

/*
 * The newest parameters, answered locally (no round trip). *out is a reference you release
 * with ts_rl_params_release. Marks its version as retrieved: later adds are tagged with it.
 * TS_ENOENT when nothing has been published yet. Added in 0.1.0.
 */
TS_EXTERN int ts_rl_worker_params(ts_rl_worker_t *w, ts_rl_params_t **out);

/*
 * Wait until parameters newer than the last retrieved ones are held, up to timeout_ms (0: do not
 * wait; TS_TIMEOUT_DEFAULT: the options' timeout_ms; TS_TIMEOUT_INFINITE: no limit). Returns 0
 * with a reference in *out (marked as retrieved), or
 * TS_ETIMEDOUT when nothing newer arrived: a timeout is never mistaken for an update.
 * TS_EDEADLK from a callback. Added in 0.1.0.
 */
TS_EXTERN int ts_rl_worker_await(ts_rl_worker_t *w, int timeout_ms, ts_rl_params_t **out);

/*
 * Send one experience item, {data, version} with the version last retrieved (-1 before any),
 * without waiting for the daemon. data is borrowed: with flags TS_COPY its memory is copied
 * during the call; with TS_BORROW it must stay valid until the add is answered: until a
 * ts_rl_worker_flush returns other than TS_ETIMEDOUT or TS_EDEADLK (see ts_rl_worker_free for
 * adds still in flight when the worker is freed). When
 * max_in_flight items or bytes are already in flight, waits for room up to the options' timeout_ms
 * (TS_ETIMEDOUT), or returns TS_EAGAIN at once with TS_RL_NONBLOCK. A failure found later, when
 * the daemon answers, is counted, reported to on_event and returned by ts_rl_worker_flush. Into a
 * replay table (options' replay) the add is one blocking insert instead: it returns the insert's
 * result itself (counted in added or add_failed, never left for ts_rl_worker_flush).
 * Added in 0.1.0.
 */
TS_EXTERN int ts_rl_worker_add(ts_rl_worker_t *w, const ts_value_t *data, unsigned flags);

/*
 * Wait until every add in flight has been answered, up to timeout_ms (0: do not wait;
 * TS_TIMEOUT_DEFAULT: the options' timeout_ms; TS_TIMEOUT_INFINITE: no limit). Returns
 * the first error of an add that failed since the previous flush (clearing it), 0 when all
 * succeeded, or TS_ETIMEDOUT when adds are still in flight. Added in 0.1.0.
 */
TS_EXTERN int ts_rl_worker_flush(ts_rl_worker_t *w, int timeout_ms);

/* A worker's counters (ts_rl_worker_stats). Added in 0.1.0. */
typedef struct ts_rl_worker_stats_s {
    int64_t version;           /* newest parameters held, -1 when none */
    int64_t retrieved_version; /* version last retrieved (what adds are tagged with), or -1 */
    uint64_t updates;          /* newer parameter sets received */
    uint64_t ignored_older;    /* parameter sets ignored because they were not newer */
    uint64_t params_failed;    /* failed or malformed reads of the parameters bin */
    uint64_t added;            /* adds the daemon confirmed */
    uint64_t add_failed;       /* adds that failed after they were sent (a replay insert: failed) */
    unsigned in_flight;        /* adds not answered yet */
    uint64_t disconnects;      /* connection losses seen */
    uint64_t resubscribes;     /* subscriptions re-established after a reconnect */
    int connected;             /* 1 while the client holds a live connection */
} ts_rl_worker_stats_t;

/* A consistent snapshot of the worker's counters. Added in 0.1.0. */
TS_EXTERN void ts_rl_worker_stats(ts_rl_worker_t *w, ts_rl_worker_stats_t *out);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_RL_H */
