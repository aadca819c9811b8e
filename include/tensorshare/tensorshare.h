/*
 * tensorshare: share tensors between training programs through the tensord daemon.
 *
 * This header is the whole public C API of libtensorshare: errors, dtypes, records (trees of
 * named tensors and scalars) and the client. Everything is C11 and usable from C++.
 *
 * Conventions (they hold for every function below, and for rl.h, batcher.h and torch.h, unless a
 * function's comment says otherwise; docs/DESIGN.md "API conventions" records why):
 * - Functions that can fail return int: 0 on success, a negative TS_E* code on failure.
 *   Out-parameters are written only on success.
 * - Error messages: a failing call also leaves a message for the calling thread in
 *   ts_last_error(), and a callback called with a failure status finds its message there too
 *   (see "Error messages" below). There is no other message channel.
 * - If a function that takes a callback returns an error, the callback is never called.
 * - Callbacks take the object first, then the status, then the results, and void *arg last; the
 *   library never reads arg. Each callback type names the thread it runs on.
 * - Blocking and asynchronous forms: ts_<object>_<verb> blocks until the result is there;
 *   ts_<object>_<verb>_async queues the work and reports through a callback (ts_put and
 *   ts_put_async, ts_batcher_predict and ts_batcher_predict_async).
 * - Timeouts: every timeout parameter is an int of milliseconds with one meaning, the
 *   TS_TIMEOUT_* rules below.
 * - Option structs are ts_<object>_options_t, filled with the defaults by
 *   ts_<object>_options_init before the caller changes fields.
 * - Pointer parameters are borrowed for the duration of the call; strings are copied.
 * - Objects freed with a _free function accept NULL (a no-op).
 * - Nothing here is thread-safe except the client (ts_client_t) functions, which may be called
 *   from any thread, and record functions on distinct records.
 * - Every declaration says in which version it appeared ("Added in 0.1.0."). While the major
 *   version is 0, a minor release may change the API and the ABI (the soname stays
 *   libtensorshare.so.0); compare TS_VERSION_HEX when you build against several.
 */
#ifndef TENSORSHARE_H
#define TENSORSHARE_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/version.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(TS_BUILDING_LIBRARY) && defined(__GNUC__)
#define TS_EXTERN __attribute__((visibility("default")))
#else
#define TS_EXTERN
#endif

/* ---------------------------------------------------------------------------------------------
 * Errors
 *
 * Codes that match an errno are its negation; the others live in -4000..-4099. The table is
 * append-only: a code never changes its number or meaning. Added in 0.1.0.
 */
#define TS_ERRNO_MAP(XX)                                                                           \
    XX(ENOMEM, -12, "out of memory (local allocation failed)")                                     \
    XX(EINVAL, -22, "invalid argument")                                                            \
    XX(ENOENT, -2, "no such bin")                                                                  \
    XX(EACCES, -13, "permission denied")                                                           \
    XX(EAGAIN, -11, "resource temporarily unavailable")                                            \
    XX(EDEADLK, -35, "blocking call made from a client callback")                                  \
    XX(ENAMETOOLONG, -36, "bin name too long")                                                     \
    XX(EMSGSIZE, -90, "message too large")                                                         \
    XX(EPROTO, -71, "protocol error")                                                              \
    XX(ENOTCONN, -107, "not connected")                                                            \
    XX(ECONNRESET, -104, "connection lost")                                                        \
    XX(ECONNREFUSED, -111, "connection refused")                                                   \
    XX(ETIMEDOUT, -110, "timed out")                                                               \
    XX(ECANCELED, -125, "operation canceled")                                                      \
    XX(EOOM, -4001, "server memory limit reached")                                                 \
    XX(EBADRECORD, -4002, "malformed record")                                                      \
    XX(EVERSION, -4003, "unsupported protocol version")                                            \
    XX(EAUTH, -4004, "authentication failed")                                                      \
    XX(ESERVER, -4005, "server internal error")                                                    \
    XX(EWRONGSHARD, -4006, "bin belongs to another shard")                                         \
    XX(ETOOMANY, -4007, "too many clients")                                                        \
    XX(EUNKNOWNOP, -4008, "operation not supported by the server")                                 \
    XX(ESLOW, -4009, "connection closed: client too slow reading")                                 \
    XX(ETYPE, -4010, "value has another type")                                                     \
    XX(ESHUTDOWN, -4011, "server shutting down")                                                   \
    XX(ETORCH, -4012, "libtorch error")                                                            \
    XX(ESCHEMA, -4013, "request does not match the schema")                                        \
    XX(EMODEL, -4014, "model failed")                                                              \
    XX(ENOTSUP, -4015, "not supported in this build")                                              \
    XX(ESAVEFAIL, -4016, "write refused: the server cannot save snapshots")                        \
    XX(ECONFLICT, -4017, "version mismatch: the bin changed")                                      \
    /* Added in 0.5.0: a gradient that lags its parameter by more than the tolerance. */           \
    XX(ESTALE, -116, "gradient too stale for the parameter")                                       \
    /* Added in 0.6.0: the server of a service left while it held the call. */                     \
    XX(ESERVICE, -4018, "service server gone")

/* The codes of TS_ERRNO_MAP as an enum (TS_ENOMEM, ...). Added in 0.1.0. */
typedef enum ts_errno_e {
    TS_OK = 0, /* not an error */
#define TS__ERR_ENUM(name, value, msg) TS_##name = (value),
    TS_ERRNO_MAP(TS__ERR_ENUM)
#undef TS__ERR_ENUM
} ts_errno_t;

/*
 * A static, human-readable message for an error code ("unknown error" for unknown codes).
 * Added in 0.1.0.
 */
TS_EXTERN const char *ts_strerror(int err);
/*
 * The code's name without the prefix, e.g. "ETIMEDOUT" ("UNKNOWN" for unknown codes).
 * Added in 0.1.0.
 */
TS_EXTERN const char *ts_err_name(int err);

/* ---------------------------------------------------------------------------------------------
 * Error messages
 *
 * One channel for every module (the client, rl.h, batcher.h, torch.h): a thread-local message,
 * like errno. A public function that fails with a negative TS_E* code sets the calling thread's
 * message before it returns: the server's reason, the libtorch exception's text, the schema
 * mismatch, the bad argument, or at least ts_strerror() of the code. Before the library calls a
 * callback with a failure status, it sets the message of the thread that runs the callback, so
 * the callback reads its reason with ts_last_error() as well. Calls that succeed may leave an
 * old message in place: read it only right after a failure. The one exception are the record
 * functions of this header (values, items, dtypes, tensors; dlpack.h): they are called in inner
 * loops, their failures (a missing key, another type, no memory) are fully said by their code
 * and comment, and they leave the message alone. Added in 0.2.0. It replaces the per-module
 * message getters of 0.1, the message field of ts_result_t and the message arguments of
 * callbacks.
 */

/* bytes; the longest message ts_last_error() keeps (longer ones are cut). Added in 0.2.0. */
#define TS_MAX_ERROR_LEN 1023

/*
 * The calling thread's message for the last failure (see above); "" when none was set. Never
 * NULL; the string stays valid until the next tensorshare call on this thread. Any thread.
 * Added in 0.2.0.
 */
TS_EXTERN const char *ts_last_error(void);

/*
 * Set the calling thread's message (copied, cut at TS_MAX_ERROR_LEN bytes; NULL sets ""). For
 * code that implements a tensorshare interface, such as a batcher model (ts_model_ops_t): a
 * model that fails sets the reason here before it returns its TS_E* code, and the batcher
 * hands it on to the requesters' callbacks. Any thread. Added in 0.2.0.
 */
TS_EXTERN void ts_set_last_error(const char *message);

/*
 * Whether the calling thread's message is that of a request the client gave up on at its
 * deadline because tensord did not answer: 1 for "no reply within the request timeout" (tensord
 * stopped, paused or too slow) and "no connection to tensord (ADDRESS: REASON) within the
 * request timeout" (the request waited in vain for the connection; REASON is why the last
 * connection or attempt failed, ADDRESS alone when the client knows no reason); 0 for any other
 * message, such as that of a TIMEOUT tensord answered (a wait, take or stream read whose time
 * ran out on the server). The answer is the message's, so it lasts as long as the message does,
 * also through the helpers (rl.h, stream.h) that pass such a failure on. Read it right after a
 * TS_ETIMEDOUT to tell "tensord said nothing came" from "tensord did not answer". Any thread.
 * Added in 0.7.2.
 */
TS_EXTERN int ts_last_error_no_reply(void);

/* ---------------------------------------------------------------------------------------------
 * Timeouts
 *
 * Every timeout parameter of every public function (int timeout_ms) takes one of:
 * - a positive number: milliseconds;
 * - 0: do not wait: check once and return (TS_ETIMEDOUT when the result is not there yet); a
 *   check the server makes still waits for the server's reply (and, while the connection is
 *   down, for the connection), up to the request timeout;
 * - TS_TIMEOUT_DEFAULT: the configured default of the object the call is on (the client's
 *   request_timeout_ms, the batcher's timeout_ms, the RL options' timeout_ms, ...; each
 *   function says which);
 * - TS_TIMEOUT_INFINITE: no limit, accepted only where a function says so (ts_wait and
 *   ts_wait_async, where the server caps the wait: tensord answers TIMEOUT after 24 hours; the
 *   batcher's predictions and weight loads; the RL trainer's and worker's waits).
 * A function that cannot honour 0 (a prediction cannot be answered without waiting) says so and
 * fails with TS_EINVAL; any other negative value is TS_EINVAL too. A wait made on the server
 * (ts_wait, ts_take, stream reads and credit, ...) has its time counted by tensord from when it
 * reads the request, and its reply is awaited for timeout_ms plus the request timeout: against
 * a server that was paused (or slow to read), such a call can return up to the request timeout
 * later than timeout_ms, and one whose reply does not come by then fails with TS_ETIMEDOUT and
 * the client's own message (ts_last_error_no_reply). Option fields that hold a
 * timeout (ts_client_options_t, ts_batcher_options_t, ts_rl_options_t) say which of these they
 * accept. The same convention as nng's NNG_DURATION_*.
 */
#define TS_TIMEOUT_INFINITE (-1) /* no limit, where accepted. Added in 0.2.0. */
#define TS_TIMEOUT_DEFAULT  (-2) /* the object's configured timeout. Added in 0.2.0. */

/* ---------------------------------------------------------------------------------------------
 * Dtypes. The numbers are the wire codes and never change. Added in 0.1.0.
 */
typedef enum ts_dtype_e {
    TS_DTYPE_INVALID = 0,
    TS_BOOL = 1,
    TS_UINT8 = 2,
    TS_INT8 = 3,
    TS_INT16 = 4,
    TS_INT32 = 5,
    TS_INT64 = 6,
    TS_FLOAT16 = 7,
    TS_BFLOAT16 = 8,
    TS_FLOAT32 = 9,
    TS_FLOAT64 = 10,
    TS_COMPLEX64 = 11,
    TS_COMPLEX128 = 12
} ts_dtype_t;

/* dimensions; a u8 on the wire, 8 covers every common model. Added in 0.1.0. */
#define TS_MAX_NDIM 8

/*
 * Protocol limits a program checks before it asks (the values never shrink within a major
 * version). TS_MAX_NAME_LEN: bytes of a bin name, which travels with a u8 length; a longer
 * name gives TS_ENAMETOOLONG. TS_MAX_DEPTH: nesting levels of a record (a map in a map is depth 2),
 * bounded so that the decoders' recursion stays small; a daemon may be configured lower, never
 * higher. Added in 0.2.0.
 */
#define TS_MAX_NAME_LEN 255 /* bytes; u8 length on the wire */
#define TS_MAX_DEPTH    32  /* record nesting levels; bounds the decoders' recursion */

/* Size of one element in bytes, 0 for an unknown dtype. Added in 0.1.0. */
TS_EXTERN size_t ts_dtype_size(ts_dtype_t dtype);
/* Short name ("float32", "bfloat16", ...), or NULL for an unknown dtype. Added in 0.1.0. */
TS_EXTERN const char *ts_dtype_name(ts_dtype_t dtype);
/* The dtype for a name as returned by ts_dtype_name, or TS_DTYPE_INVALID. Added in 0.1.0. */
TS_EXTERN ts_dtype_t ts_dtype_from_name(const char *name);

/*
 * A tensor descriptor, shaped like DLPack's DLTensor. Tensors are always dense and row-major
 * (C-contiguous); data is 64-byte aligned when it comes from tensorshare. Added in 0.1.0.
 */
typedef struct ts_tensor_s {
    void *data;
    ts_dtype_t dtype;
    int32_t ndim;
    int64_t shape[TS_MAX_NDIM];
} ts_tensor_t;

/* Number of elements (1 for ndim 0). Added in 0.1.0. */
TS_EXTERN int64_t ts_tensor_numel(const ts_tensor_t *t);
/* Size of the data in bytes. Added in 0.1.0. */
TS_EXTERN size_t ts_tensor_nbytes(const ts_tensor_t *t);

/* ---------------------------------------------------------------------------------------------
 * Values and records
 *
 * A record is what a bin item holds: a tree of values. Maps have string keys (kept in insertion
 * order, keys unique), lists hold values, leaves are tensors, 64-bit ints, doubles, strings or
 * byte strings. A record's root can be any value, typically a map such as
 * {"params": {...state dict...}, "version": 7}.
 *
 * Values you build are owned by you until added to a container (ownership then transfers to the
 * container) or freed with ts_value_free. Values received from a server live inside one buffer
 * and are read-only. A received record handed to you on its own, as a ts_value_t *, is yours:
 * free the whole tree (and its buffer) with ts_value_free. These are ts_stats's *out (and
 * res->value of ts_stats_async, when the callback keeps it), ts_stream_info's and ts_table_info's
 * *out, ts_call's *answer, the request of a ts_service_cb and ts_stream_consumer_next's *value.
 * Every other received value is part of the object that returned it and stays valid until that
 * object is freed: the records of a ts_items_t (ts_items_free), ts_rl_batch_data's
 * (ts_rl_batch_free), ts_rl_params_value's (the last ts_rl_params_release) and ts_shared_value's
 * (ts_shared_free), and every value inside a received tree. Added in 0.1.0.
 */
typedef enum ts_type_e {
    TS_TYPE_MAP = 1,
    TS_TYPE_LIST = 2,
    TS_TYPE_TENSOR = 3,
    TS_TYPE_INT = 4,
    TS_TYPE_FLOAT = 5,
    TS_TYPE_STRING = 6,
    TS_TYPE_BYTES = 7
} ts_type_t;

/* A value of a record (opaque). Added in 0.1.0. */
typedef struct ts_value_s ts_value_t;

/* Flags for values that wrap caller memory. Added in 0.1.0. */
#define TS_BORROW 0u /* keep a pointer; the memory must outlive the value (default) */
#define TS_COPY   1u /* copy the memory now into a 64-byte aligned buffer the value owns */

/* An empty map or list, an int, a double; NULL on allocation failure. Added in 0.1.0. */
TS_EXTERN ts_value_t *ts_map_new(void);
TS_EXTERN ts_value_t *ts_list_new(void);
TS_EXTERN ts_value_t *ts_int_new(int64_t v);
TS_EXTERN ts_value_t *ts_float_new(double v);
/* A string value; s is copied (it need not be NUL-free: len bytes are taken). Added in 0.1.0. */
TS_EXTERN ts_value_t *ts_string_new(const char *s, size_t len);
/*
 * A byte string; with TS_BORROW, data must stay valid while the value (or a put of it) uses it.
 * Added in 0.1.0.
 */
TS_EXTERN ts_value_t *ts_bytes_new(const void *data, size_t len, unsigned flags);
/*
 * A tensor value over caller memory (data may be NULL only when the tensor has 0 elements).
 * With TS_BORROW the memory must stay valid while the value is used, including until a put's
 * callback; with TS_COPY it is copied now. Returns NULL on bad arguments or allocation failure.
 * Added in 0.1.0.
 */
TS_EXTERN ts_value_t *ts_tensor_new(ts_dtype_t dtype, int ndim, const int64_t *shape,
                                    const void *data, unsigned flags);
/*
 * A tensor value owning fresh zeroed, 64-byte aligned memory; fill it via ts_value_tensor().
 * Added in 0.1.0.
 */
TS_EXTERN ts_value_t *ts_tensor_alloc(ts_dtype_t dtype, int ndim, const int64_t *shape);
/*
 * A tensor value over memory that someone else owns and that must stay valid until
 * release(owner) is called. release (may be NULL) is called exactly once, from the thread that
 * frees the value, when the value is freed; it is not called when this returns NULL (bad
 * arguments, allocation failure). Lets several values share one buffer under a reference count
 * of the caller's. Added in 0.2.0.
 */
TS_EXTERN ts_value_t *ts_tensor_new_external(ts_dtype_t dtype, int ndim, const int64_t *shape,
                                             const void *data, void (*release)(void *owner),
                                             void *owner);
/*
 * Change the first dimension (the row count) of a tensor value you built, in place, keeping its
 * memory: the value then covers the first rows rows of the memory it was made over (reuse of a
 * preallocated batch buffer). Checks: v is a built (not received) tensor value with ndim >= 1,
 * rows >= 0, and rows rows fit in the bytes the value was created with (ts_tensor_alloc,
 * ts_tensor_new or ts_tensor_new_external). 0, or TS_EINVAL with v unchanged. Not thread-safe
 * against readers of v. Added in 0.2.0.
 */
TS_EXTERN int ts_value_tensor_set_rows(ts_value_t *v, int64_t rows);

/*
 * Add to containers. The child's ownership transfers to the container on success; on failure
 * the child is freed as well, so calls can be nested without leaks:
 *   ts_map_set(m, "w", ts_tensor_new(...)).
 * ts_map_set replaces the value under an existing key. A NULL child gives TS_ENOMEM (it is what
 * a failed constructor returns). Added in 0.1.0.
 */
TS_EXTERN int ts_map_set(ts_value_t *map, const char *key, ts_value_t *child);
TS_EXTERN int ts_list_push(ts_value_t *list, ts_value_t *child);

/*
 * Free a value you own, with all its children: one you built, or a received record that is yours
 * (see "Values and records" above: ts_stats's *out, ts_call's *answer, ...). Never call it on a
 * received value that is part of another object (an item of a ts_items_t, a value inside a
 * received tree). Added in 0.1.0.
 */
TS_EXTERN void ts_value_free(ts_value_t *v);

/* Reading. These work on built and received values alike. Added in 0.1.0. */
TS_EXTERN ts_type_t ts_value_type(const ts_value_t *v);
/* Number of entries of a map or list, 0 for other types. Added in 0.1.0. */
TS_EXTERN size_t ts_value_len(const ts_value_t *v);
/* A map's value for key, or NULL if v is not a map or has no such key. Added in 0.1.0. */
TS_EXTERN const ts_value_t *ts_map_get(const ts_value_t *map, const char *key);
/* The i-th key (NUL-terminated) and value of a map, or NULL when out of range. Added in 0.1.0. */
TS_EXTERN const char *ts_map_key_at(const ts_value_t *map, size_t i);
TS_EXTERN const ts_value_t *ts_map_value_at(const ts_value_t *map, size_t i);
/* The i-th element of a list, or NULL when out of range. Added in 0.1.0. */
TS_EXTERN const ts_value_t *ts_list_at(const ts_value_t *list, size_t i);
/*
 * The tensor of a tensor value (its data is writable for values you own), or NULL.
 * Added in 0.1.0.
 */
TS_EXTERN const ts_tensor_t *ts_value_tensor(const ts_value_t *v);
/* Scalars: TS_ETYPE when v has another type. ts_value_float also accepts an int. Added in 0.1.0. */
TS_EXTERN int ts_value_int(const ts_value_t *v, int64_t *out);
TS_EXTERN int ts_value_float(const ts_value_t *v, double *out);
/*
 * Strings and bytes: a pointer into the value (strings are NUL-terminated) and the length.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_value_string(const ts_value_t *v, const char **s, size_t *len);
TS_EXTERN int ts_value_bytes(const ts_value_t *v, const void **data, size_t *len);

/*
 * Shortcuts for the common map lookups; TS_ENOENT when the key is missing, TS_ETYPE on type.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_map_get_int(const ts_value_t *map, const char *key, int64_t *out);
TS_EXTERN const ts_tensor_t *ts_map_get_tensor(const ts_value_t *map, const char *key);

/*
 * A deep copy of any value (received or built) that you own; tensor data is copied.
 * Added in 0.1.0.
 */
TS_EXTERN ts_value_t *ts_value_clone(const ts_value_t *v);
/*
 * A tree of v's shape that you own whose tensors and byte strings point at v's memory instead of
 * copying it (TS_BORROW); maps, lists, scalars and strings are new nodes. v (and, for a received
 * value, the object that returned it) must outlive the borrowed tree and must not change while
 * it is used; freeing the borrowed tree never touches v's memory. Use it to send a record you
 * were given inside a record of your own without copying its tensors. NULL when v is NULL, on
 * allocation failure, or when v is nested deeper than TS_MAX_DEPTH. Added in 0.2.0.
 */
TS_EXTERN ts_value_t *ts_value_borrow(const ts_value_t *v);

/*
 * Encoded size in bytes of v as a record (what a put sends and a server stores), or 0 when v
 * cannot be encoded (too deep, more than the limits allow). Added in 0.1.0.
 */
TS_EXTERN size_t ts_value_encoded_size(const ts_value_t *v);

/* ---------------------------------------------------------------------------------------------
 * Items returned by get and peek. Added in 0.1.0.
 */
typedef struct ts_items_s ts_items_t;

/* Number of items (records) returned. Added in 0.1.0. */
TS_EXTERN size_t ts_items_count(const ts_items_t *items);
/*
 * The i-th item (oldest first), valid until ts_items_free, or NULL when out of range.
 * Added in 0.1.0.
 */
TS_EXTERN const ts_value_t *ts_items_at(const ts_items_t *items, size_t i);
/* The bin's version after the operation. Added in 0.1.0. */
TS_EXTERN uint64_t ts_items_version(const ts_items_t *items);
/* Items still in the bin after the operation (0 after a get of everything). Added in 0.1.0. */
TS_EXTERN uint32_t ts_items_remaining(const ts_items_t *items);
TS_EXTERN void ts_items_free(ts_items_t *items);

/* One entry of a list reply. Added in 0.1.0. */
typedef struct ts_bin_info_s {
    const char *name; /* NUL-terminated; valid until ts_bin_list_free */
    uint32_t n_items;
    uint64_t bytes;   /* encoded bytes held by the bin's items */
    uint64_t version; /* version of the bin's last change */
} ts_bin_info_t;

/* A list reply: count entries. Added in 0.1.0. */
typedef struct ts_bin_list_s {
    size_t count;
    ts_bin_info_t *bins; /* sorted by name */
} ts_bin_list_t;

/* Free a list reply. NULL is a no-op. Added in 0.1.0. */
TS_EXTERN void ts_bin_list_free(ts_bin_list_t *list);

/* ---------------------------------------------------------------------------------------------
 * The client
 *
 * A ts_client_t holds one connection to a tensord and one I/O thread. Every ts_ client function
 * is thread-safe: any number of threads may share one client, and their requests pipeline on one
 * connection. Callbacks run on the client's I/O thread; a blocking call made from inside a
 * callback returns TS_EDEADLK instead of deadlocking. If the connection drops, requests in
 * flight fail with TS_ECONNRESET, the client reconnects on its own with backoff, and
 * subscriptions are re-established. A server that breaks the protocol (a malformed frame) is
 * treated the same way, except that the requests in flight fail with TS_EPROTO. When tensord
 * stops cleanly (SIGTERM or SIGINT), it answers every request in flight, the ones waiting on the
 * server (ts_wait, ts_take, stream reads, ...) included, with SHUTTING_DOWN, then closes the
 * connection (docs/PROTOCOL.md section 13): those requests fail with TS_ESHUTDOWN ("tensord is
 * shutting down"), and the client reconnects as above. TS_ECONNRESET is for a connection lost
 * otherwise. See docs/THREADING.md. Added in 0.1.0.
 */
typedef struct ts_client_s ts_client_t;

/*
 * The client's options; fill with ts_client_options_init, then change fields. The timeouts
 * and the reconnect backoff (the _ms fields) are positive milliseconds, or TS_TIMEOUT_DEFAULT
 * for the built-in default; 0 and TS_TIMEOUT_INFINITE give TS_EINVAL at ts_client_open (a
 * request without a deadline could hang its caller forever on a dead server), and so does a
 * reconnect_max_ms below reconnect_min_ms (after defaults), with ts_last_error() naming the field.
 * Added in 0.2.0. It replaces ts_options_t. Changed in 0.7.1: the reconnect fields are checked
 * (before, 0 and other negative values meant the default, and a maximum below the minimum was
 * raised to it).
 */
typedef struct ts_client_options_s {
    int connect_timeout_ms; /* first connection and each reconnect attempt; default 5000 */
    /*
     * What TS_TIMEOUT_DEFAULT means for this client: the limit of every blocking call and
     * asynchronous request, and of a wait's reply beyond its own timeout; default 30000.
     */
    int request_timeout_ms;
    int reconnect_min_ms; /* first backoff after a lost connection; default 50 */
    int reconnect_max_ms; /* backoff doubles up to this; default 2000 */
    /*
     * Copied; NULL: take TS_AUTH_TOKEN from the environment; "": none. Trailing spaces, tabs,
     * CRs and LFs are not part of the token (tensord drops them from its own too); a token of
     * nothing else gives TS_EINVAL at ts_client_open. Changed in 0.7.1: trimmed.
     */
    const char *auth_token;
    size_t compress_min; /* lz4-compress frames at least this large (if the server agrees);
                            0 = never; default 0 (see docs/PERFORMANCE.md) */
    /*
     * The largest reply body the client accepts, in bytes (after decompression): the replies
     * that return records or lists (GET, PEEK, TAKE, GET_REF, PEEK_REF, READ_ROWS, GATHER_ROWS,
     * MGET, LIST, STATS, STREAM_READ, STREAM_RANGE, STREAM_INFO, TABLE_SAMPLE, PS_PULL, EMB_PULL,
     * a service call's answer) and the service requests a serving client is handed. Checked on
     * the frame's header before anything is buffered; a larger reply fails its request with
     * TS_EPROTO and closes the connection (fetch large bins in parts with max_items), and so does
     * a larger service request (the callers of the calls it held get TS_ESERVICE, and it
     * registers again on reconnecting): a client that calls or serves services with large
     * tensors needs a limit above them. Replies of other operations have small fixed bounds of
     * their own. 0 = the default, TS_DEFAULT_MAX_REPLY_BYTES. Added in 0.2.0.
     */
    uint64_t max_reply_bytes;
    /*
     * TLS (docs/TLS.md), for addresses "tls://host:port" (or any TCP address with tls set). The
     * server's certificate is verified against tls_ca_file (PEM; NULL: the TS_TLS_CA environment
     * variable, else the system's store) and must name tls_server_name (NULL: the address's
     * host, a name or an IP address). tls_cert_file and tls_key_file (PEM, both or neither) are
     * the client certificate a tensord with --tls-client-ca asks for. Strings are copied at
     * ts_client_open; a certificate that fails verification fails ts_client_open with TS_EAUTH
     * and the reason in ts_last_error(); a build without TLS gives TS_ENOTSUP. Blocking calls on
     * a TLS connection never use the caller-side fast path (every byte goes through the client's
     * I/O thread). A cluster client gives every shard, those learned later included, all these
     * fields and checks them at ts_client_open as a single client does; TS_TLS_CA is read once,
     * at ts_client_open, and tls_server_name is the name every shard's certificate must carry
     * (NULL: each shard's own host). Added in 0.5.0. Changed in 0.7.1: cluster clients take them.
     */
    const char *tls_ca_file;
    const char *tls_cert_file;
    const char *tls_key_file;
    const char *tls_server_name;
    /* 1: TLS even without "tls://" in the address (not on unix sockets). Added in 0.5.0. */
    int tls;
} ts_client_options_t;

/* bytes; the default of ts_client_options_t.max_reply_bytes: 4 GiB. Added in 0.2.0. */
#define TS_DEFAULT_MAX_REPLY_BYTES ((uint64_t)4 << 30)

/* Fill opts with the defaults. Added in 0.2.0. It replaces ts_options_init. */
TS_EXTERN void ts_client_options_init(ts_client_options_t *opts);

/*
 * Connect to a tensord. address is "host:port", "[v6addr]:port", "tcp://host:port",
 * "tls://host:port" (docs/TLS.md), "unix:/path" or "unix:///path"; out receives the client.
 * opts may be NULL for the defaults. Blocks until connected and the handshake is done, or the
 * connect timeout passes (TS_ETIMEDOUT). A refused connection fails at once (TS_ECONNREFUSED;
 * also for a missing unix socket), and so does a unix socket this user may not connect to
 * (TS_EACCES, "permission denied connecting to the socket": its file's mode, or a directory's
 * on its path, refuses it); an unresolvable host gives TS_ENOTCONN; a NULL out or address, an
 * invalid option and a malformed address ("malformed address '...'": one with another scheme,
 * such as "http://", a host with '/', '[', ']', ',' or a blank in it, a port missing or outside
 * 1..65535) give TS_EINVAL; ts_last_error() then says why.
 * Added in 0.1.0.
 *
 * A cluster of sharded tensord (docs/CLUSTER.md): address is a comma-separated list of such
 * addresses, "h1:7000,h2:7000,h3:7000" (shard i is the i-th, the default split of the slots; an
 * address given twice, "h1:7000" and "tcp://h1:7000" included, is TS_EINVAL), or
 * "cluster:/path/to/map", a map file (docs/PROTOCOL.md section 14). The client returned is used
 * exactly like a single one: each call that names a bin, stream, table or counter goes to the
 * shard that owns the name; LIST, STATS, PING and SAVE ask every shard and merge; callbacks
 * receive this client. ts_client_open returns once every shard's first connection attempt has
 * ended (each bounded by the connect timeout: a shard that accepts TCP but never answers makes
 * it wait that long) and the connected shards have answered SHARD_MAP (bounded by the request
 * timeout); it succeeds when at least one shard connected (the others keep reconnecting in the
 * background) and fails as above when none did. A call for a shard that is down fails at once
 * with TS_ENOTCONN (ts_last_error() names the shard); a stale map is corrected by the daemons'
 * WRONG_SHARD answers (at most 3 redirects per request, then TS_EWRONGSHARD). Cluster addresses
 * are Added in 0.5.0.
 */
TS_EXTERN int ts_client_open(ts_client_t **out, const char *address,
                             const ts_client_options_t *opts);

/*
 * Close the client: pending requests complete with TS_ECANCELED, subscriptions get their final
 * callback, the connection and the I/O thread end. Other threads may be waiting in blocking
 * calls on c meanwhile: those calls return TS_ECANCELED, and c is freed only after the last of
 * them has returned. No call on c may start once ts_client_free has been called, except from
 * the callbacks it runs. May be called from a callback (the client is then freed once the
 * callback returns). NULL is a no-op. Added in 0.1.0.
 */
TS_EXTERN void ts_client_free(ts_client_t *c);

/*
 * 1 when the client currently holds a live, handshaken connection, else 0; for a cluster client,
 * 1 when every shard that owns slots is connected (0.5.0). Added in 0.1.0.
 */
TS_EXTERN int ts_client_connected(ts_client_t *c);

/*
 * Result of an operation, passed to asynchronous callbacks. A failed operation's message (the
 * server's reason) is in ts_last_error() during the callback. Added in 0.1.0.
 * Changed in 0.2.0: the message field is gone.
 */
typedef struct ts_result_s {
    uint64_t version;    /* the bin's version after the operation (0 for list, stats, ping) */
    uint32_t n_items;    /* items in the bin after the operation; for delete, items removed */
    ts_items_t *items;   /* get and peek: set to NULL to keep them, else freed after the cb */
    ts_bin_list_t *bins; /* list: set to NULL to keep it, else freed after the callback */
    ts_value_t *value;   /* stats: a map; set to NULL to keep it (then ts_value_free it), else
                            freed after the callback */
} ts_result_t;

/*
 * Completion callback of every asynchronous call. Called exactly once, on the client's I/O
 * thread, never from inside the call that queued the request. status is 0 or a TS_E* code (its
 * message in ts_last_error()). Added in 0.1.0.
 */
typedef void (*ts_result_cb)(ts_client_t *c, int status, ts_result_t *res, void *arg);

/*
 * Blocking operations. Each waits at most the client's request timeout (TS_ETIMEDOUT), returns
 * TS_EDEADLK when called from a client callback, and on failure leaves the server's message (or
 * the local reason) in ts_last_error().
 *
 * put replaces the bin's content with one item; append adds one item (creating the bin). The
 * item's tensor memory is read during the call only. version (may be NULL) receives the bin's
 * new version. Added in 0.1.0.
 */
TS_EXTERN int ts_put(ts_client_t *c, const char *bin, const ts_value_t *item, uint64_t *version);
TS_EXTERN int ts_append(ts_client_t *c, const char *bin, const ts_value_t *item, uint64_t *version);
/*
 * get returns the oldest max_items items (0 = all) and removes them; the bin disappears when
 * empty. peek returns them and keeps them. A missing bin is TS_ENOENT. *out is yours to free.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_get(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out);
TS_EXTERN int ts_peek(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out);
/*
 * Remove a bin. A missing bin is not an error (n_removed = 0). n_removed may be NULL.
 * Added in 0.1.0.
 */
TS_EXTERN int ts_delete(ts_client_t *c, const char *bin, uint32_t *n_removed);
/*
 * Every bin with its item count, bytes and version. *out is yours (ts_bin_list_free).
 * Added in 0.1.0.
 */
TS_EXTERN int ts_list(ts_client_t *c, ts_bin_list_t **out);
/*
 * Wait until the bin's version is greater than after_version (a missing bin has version 0), at
 * most timeout_ms (see "Timeouts": TS_TIMEOUT_DEFAULT is the client's request timeout; 0 asks
 * the server once and never waits; TS_TIMEOUT_INFINITE waits as long as the server allows:
 * tensord caps a wait at 24 hours). Returns 0 with the version and item count, or TS_ETIMEDOUT
 * (then *version and *n_items hold the current state, when the server answered). version and
 * n_items may be NULL. The wait may be longer than the request timeout: the reply is awaited
 * for timeout_ms plus the request timeout. Added in 0.1.0.
 */
TS_EXTERN int ts_wait(ts_client_t *c, const char *bin, uint64_t after_version, int timeout_ms,
                      uint64_t *version, uint32_t *n_items);
/*
 * Server statistics as a map of ints (uptime_s, connections, bins, items, bytes, ...). *out is
 * yours: free it with ts_value_free. Added in 0.1.0.
 */
TS_EXTERN int ts_stats(ts_client_t *c, ts_value_t **out);
/* A round trip to the server. Added in 0.1.0. */
TS_EXTERN int ts_ping(ts_client_t *c);
/*
 * Ask the server for a snapshot and wait until it is durable on the server's disk (tensord
 * started with --save; otherwise TS_EINVAL with the server's message). Bounded by the request
 * timeout. Added in 0.1.0.
 */
TS_EXTERN int ts_save(ts_client_t *c);

/*
 * Asynchronous forms: the callback is called exactly once (see ts_result_cb); cb may be NULL
 * when the result does not matter. For put and append, the item's metadata is encoded during
 * the call, and its tensor and bytes memory is retained (read by the I/O thread) until the
 * callback unless flags has TS_COPY. ts_wait_async's timeout_ms is ts_wait's. A request made
 * while the connection is down waits for the reconnection until its deadline (the request
 * timeout; for wait, its own timeout plus the request timeout), unless a reconnection attempt
 * is turned away first: the server's certificate fails verification (TS_EAUTH) or the TLS
 * handshake fails otherwise (TS_EPROTO), the server refuses the handshake (a wrong token:
 * TS_EAUTH), or it closes the connection with an error frame (its code). The waiting requests
 * then fail at once with that code, ts_last_error() "HOST:PORT: " and the reason, as a failed
 * ts_client_open says it; the client keeps trying. (A cluster's shard that is down fails its
 * requests at once with TS_ENOTCONN, see ts_client_open.) Added in 0.1.0.
 */
TS_EXTERN int ts_put_async(ts_client_t *c, const char *bin, const ts_value_t *item, unsigned flags,
                           ts_result_cb cb, void *arg);
TS_EXTERN int ts_append_async(ts_client_t *c, const char *bin, const ts_value_t *item,
                              unsigned flags, ts_result_cb cb, void *arg);
TS_EXTERN int ts_get_async(ts_client_t *c, const char *bin, size_t max_items, ts_result_cb cb,
                           void *arg);
TS_EXTERN int ts_peek_async(ts_client_t *c, const char *bin, size_t max_items, ts_result_cb cb,
                            void *arg);
TS_EXTERN int ts_delete_async(ts_client_t *c, const char *bin, ts_result_cb cb, void *arg);
TS_EXTERN int ts_list_async(ts_client_t *c, ts_result_cb cb, void *arg);
TS_EXTERN int ts_wait_async(ts_client_t *c, const char *bin, uint64_t after_version, int timeout_ms,
                            ts_result_cb cb, void *arg);
TS_EXTERN int ts_stats_async(ts_client_t *c, ts_result_cb cb, void *arg);
TS_EXTERN int ts_ping_async(ts_client_t *c, ts_result_cb cb, void *arg);

/* What a notification reports. The numbers match the wire's. Added in 0.1.0. */
typedef enum ts_event_e {
    TS_EV_PUT = 1,
    TS_EV_APPEND = 2,
    TS_EV_GET = 3,
    TS_EV_DELETE = 4,
    TS_EV_ROWS = 5,           /* rows written in place into a tensor bin (Added in 0.3.0) */
    TS_EV_DISCONNECTED = 100, /* connection lost; changes may be missed until RESUBSCRIBED */
    TS_EV_RESUBSCRIBED = 101  /* listening again after a reconnect: re-read the bin */
} ts_event_t;

/* One change of a subscribed bin, passed to ts_notify_cb. Added in 0.1.0. */
typedef struct ts_notification_s {
    const char *bin; /* NUL-terminated, valid during the callback */
    ts_event_t event;
    uint64_t version; /* the bin's version after the change */
    uint32_t n_items; /* items in the bin after the change */
    int coalesced;    /* 1 when the server merged several changes into this one */
} ts_notification_t;

/*
 * Called on the I/O thread: 0..N times with status 0 (one per change, in order), then exactly
 * once with status < 0 (TS_ECANCELED after ts_unlisten or ts_client_free, or the error that
 * made listen fail, its message in ts_last_error()) and n == NULL, after which the library
 * never touches arg again. Added in 0.1.0.
 */
typedef void (*ts_notify_cb)(ts_client_t *c, int status, const ts_notification_t *n, void *arg);

/*
 * Subscribe to a bin's changes (every put, append, get and delete, by any client, this one
 * included). Blocks until the server confirms: every change after ts_listen returns 0 is
 * delivered. One subscription per bin per client; listening again to the same bin gives
 * TS_EINVAL. Subscriptions survive reconnects (TS_EV_DISCONNECTED, then TS_EV_RESUBSCRIBED);
 * if the server refuses one after a reconnect, its final call carries that error. When
 * ts_listen itself fails, cb is never called. Added in 0.1.0.
 */
TS_EXTERN int ts_listen(ts_client_t *c, const char *bin, ts_notify_cb cb, void *arg);
/*
 * End a subscription; its callback gets its final TS_ECANCELED call (later, on the I/O thread).
 * Does not block, so it may be called from any callback. TS_ENOENT if none. Added in 0.1.0.
 */
TS_EXTERN int ts_unlisten(ts_client_t *c, const char *bin);

/* ---------------------------------------------------------------------------------------------
 * Same-host zero copy (unix sockets)
 *
 * A client connected to "unix:/path" may exchange items by reference: the server hands large
 * items over as file descriptors that the client maps read-only (no copy of the data through the
 * socket), and the client hands the server a shared buffer (a memfd) that it filled in place,
 * which the server seals and keeps without copying. The descriptors travel on a second unix
 * connection of the client (its "descriptor lane"), opened on first use and only by the calls of
 * this section; the client's main connection is not involved. The lane is a second client
 * connection for the server (it counts against tensord's --max-clients); it is reopened after
 * an error and closed by ts_client_free. Over TCP, or when the server does not grant descriptors
 * (tensord --no-fds, or a server older than 0.3) or has no room for the lane (TOO_MANY_CLIENTS;
 * asked again 10 s later), every call of this section falls back to its copying form (ts_get,
 * ts_peek, ts_put, ts_append) with the same results. By reference is
 * never the default: a program asks for it per call. See docs/DESIGN.md "Same-host zero copy".
 * Added in 0.3.0.
 */

/* items; the most one by-reference get or peek returns (the rest stay). Added in 0.3.0. */
#define TS_REF_MAX_ITEMS 64

/*
 * ts_get and ts_peek by reference: the items come back as a ts_items_t like theirs, but the
 * records of large items (those the server holds in shared memory or in its data directory)
 * are read-only mappings of the server's files instead of copies received through the socket;
 * small items arrive inline. Each mapped record is validated like any received record. The
 * tensors' data is read-only (writing it faults); it stays valid until ts_items_free, also after
 * the item has left the bin or the server has ended. Items of a tensor bin are mapped shared:
 * their data changes in place when the bin's rows are written. At most TS_REF_MAX_ITEMS items
 * per call (max_items 0 or above it means TS_REF_MAX_ITEMS); ts_items_remaining tells the rest.
 * Over TCP or without descriptors from the server these are ts_get and ts_peek (max_items as
 * given). Blocking (the client's request timeout; TS_EDEADLK from a client callback); calls of
 * several threads on one client take turns on the lane. The lane is a second connection: these
 * calls, ts_shared_put and ts_shared_append are ordered among themselves and with blocking
 * calls, but not with asynchronous requests still in flight on the client's connection (a
 * ts_put_async's item may not be there yet, and may arrive after a later ts_shared_put); wait
 * for their callbacks first (docs/THREADING.md "Ordering guarantees"). Errors: those of ts_get,
 * plus TS_EPROTO
 * when the server's reply or a descriptor it sent is malformed (the lane is then closed and
 * every descriptor received closed), TS_ECANCELED when the client is freed meanwhile. *out is
 * yours (ts_items_free unmaps). Any thread. Added in 0.3.0.
 */
TS_EXTERN int ts_get_ref(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out);
TS_EXTERN int ts_peek_ref(ts_client_t *c, const char *bin, size_t max_items, ts_items_t **out);

/*
 * A shared buffer: one record, encoded in a memfd of this process, whose tensors the program
 * writes in place before handing the whole buffer to the server (a put or append without
 * copying the data through the socket). Life: ts_shared_new, fill the tensors, ts_shared_put or
 * ts_shared_append (once), ts_shared_free. Not thread-safe: one thread at a time per buffer.
 * Added in 0.3.0.
 */
typedef struct ts_shared_s ts_shared_t;

/*
 * A tensor value without memory, for layouts: it gives ts_shared_new a dtype and a shape only.
 * Its data reads as zeros (a read-only mapping that uses no memory until read); you own it like
 * any built value. NULL on bad arguments or when the address space is exhausted. Any thread.
 * Added in 0.3.0.
 */
TS_EXTERN ts_value_t *ts_tensor_spec_new(ts_dtype_t dtype, int ndim, const int64_t *shape);

/*
 * A shared buffer holding the record of layout, a value tree you build (and keep: it is only
 * read during the call). Tensors in layout give their dtype and shape; their data is NOT read
 * (the buffer's tensors start as zeros): build them with ts_tensor_spec_new. Every other value
 * (ints, floats, strings, byte strings, keys) is copied. 0 and *out (yours: ts_shared_free), or
 * TS_EINVAL (NULL arguments, a layout beyond the protocol's limits), TS_ENOMEM, TS_ENOTSUP (no
 * memfd on this system). Any thread. Added in 0.3.0.
 *
 * Memory: the buffer is a memfd of ts_shared_size bytes. This call allocates all its pages when
 * it is at most 64 MiB, or at most half of MemAvailable in /proc/meminfo (a memory cgroup's
 * limit is not consulted): one allocation costs less than a fault per page when every tensor is
 * then written. A larger buffer (or any when /proc/meminfo cannot be read) takes a page only
 * when the page is first touched (read or written; this call writes the record's head and byte
 * strings, a commit that sends the record over TCP reads all of it), so a buffer larger than the
 * memory can be made and only what is used counts; a page touched when no memory is left fails
 * as any page fault does (the kernel's OOM killer). The pages stay until ts_shared_free, or,
 * once committed, are the server's.
 */
TS_EXTERN int ts_shared_new(const ts_value_t *layout, ts_shared_t **out);
/*
 * The buffer's record as a read-only tree of layout's shape whose tensors' data lies in the
 * buffer and is writable in place: (void *)ts_value_tensor(ts_map_get(v, "x"))->data. Valid until
 * the buffer is committed or freed. NULL once a commit has succeeded (or after a failed commit
 * that the server had already sealed): the buffer is then the server's. Added in 0.3.0.
 */
TS_EXTERN const ts_value_t *ts_shared_value(const ts_shared_t *sh);
/* Bytes of the encoded record (what the server stores). Added in 0.3.0. */
TS_EXTERN size_t ts_shared_size(const ts_shared_t *sh);
/*
 * Commit the buffer as the bin's only item (put) or as a new item (append). The writable mapping
 * is withdrawn first: from then on the buffer's tensors are inaccessible, and a write through a
 * pointer taken before faults (SIGSEGV) instead of changing what the server stores; on a unix
 * socket the memfd itself is sent (the server seals it and keeps it without a copy), over TCP
 * or without descriptors from the server the record is sent as ts_put does. version (may be
 * NULL) gets the bin's new version. On success ts_shared_value is NULL and a second commit is
 * TS_EINVAL. On failure the error is ts_put's (TS_EINVAL "shared buffer is still mapped
 * writable" when another process, such as a forked child, still maps it): when the server had
 * not sealed the memfd, the buffer is writable again and may be committed again; when it had,
 * it may only be committed again, unchanged. Blocking, any thread (one at a time per buffer).
 * On a unix socket the commit goes on the descriptor lane (see ts_get_ref): it is ordered with
 * blocking calls but not with asynchronous requests still in flight on the client's connection
 * (after ts_put_async(c, bin, A) and ts_shared_put(c, bin, B), the bin may hold A); wait for
 * their callbacks first. Added in 0.3.0.
 */
TS_EXTERN int ts_shared_put(ts_client_t *c, const char *bin, ts_shared_t *sh, uint64_t *version);
TS_EXTERN int ts_shared_append(ts_client_t *c, const char *bin, ts_shared_t *sh, uint64_t *version);
/*
 * Free the buffer: its mapping and this process's descriptor (a committed item stays on the
 * server). The tree of ts_shared_value goes with it. NULL is a no-op. Added in 0.3.0.
 */
TS_EXTERN void ts_shared_free(ts_shared_t *sh);

/* ---------------------------------------------------------------------------------------------
 * Tensor bins and rows
 *
 * A tensor bin holds one preallocated tensor (a record whose root is the tensor) that is written
 * in place, a range of rows at a time, and read by rows: an embedding table, a replay buffer, a
 * parameter shard that many workers update and read in parts. ts_tensor_bin_create makes it
 * zero-filled; ts_rows_write writes rows [start, start + k) in place (the bin's version moves on,
 * listeners get TS_EV_ROWS, waits are answered); ts_rows_read and ts_rows_gather return copies of
 * rows, taken when the server handles the request. ts_peek returns the whole tensor, and
 * ts_peek_ref maps it shared on the same host (its data then changes as rows are written). A
 * tensor bin refuses put, append and get (TS_EINVAL): delete it to reuse its name. The row reads
 * also work on any bin's items: the item's root tensor, or a tensor under a key of its root map.
 * The blocking calls wait at most the client's request timeout (TS_EDEADLK from a client
 * callback), may be called from any thread and leave the server's reason in ts_last_error() on
 * failure; each has an asynchronous form. docs/PROTOCOL.md
 * 8.19 to 8.22 has the rules. Added in 0.3.0.
 */

/*
 * Create bin as a tensor bin of dtype and shape (ndim 1 to TS_MAX_NDIM, every dim >= 0),
 * zero-filled. version (may be NULL) gets the bin's version. Errors: TS_EINVAL (bad arguments,
 * the bin exists, a shape too large for a record), TS_EOOM (over the server's --max-memory).
 * Added in 0.3.0.
 */
TS_EXTERN int ts_tensor_bin_create(ts_client_t *c, const char *bin, ts_dtype_t dtype, int ndim,
                                   const int64_t *shape, uint64_t *version);
/*
 * Rows [start, end) of a tensor of the bin's item number item (0 = the oldest, -1 = the newest;
 * a tensor bin's one item is 0 or -1): the item's root tensor when key is NULL or "", else the
 * tensor under key in its root map. *out holds one item whose root is a tensor of shape
 * [end - start, shape[1..]] (yours: ts_items_free; its version is the bin's). Errors: TS_ENOENT
 * (no such bin or key), TS_EINVAL (no such item, a key given for an item whose root is not a
 * map, not a tensor, a tensor of 0 dimensions, rows out of range, a key over 1024 bytes),
 * TS_EOOM. Added in 0.3.0.
 */
TS_EXTERN int ts_rows_read(ts_client_t *c, const char *bin, int item, const char *key,
                           int64_t start, int64_t end, ts_items_t **out);
/*
 * The rows index[0..n) of the same tensor, in that order (repeats allowed; each 0 <= index[i] <
 * the tensor's rows; n at most 4194304): *out holds one item whose root is a tensor of shape
 * [n, shape[1..]]. Errors as ts_rows_read's (an index out of range: TS_EINVAL). Added in 0.3.0.
 */
TS_EXTERN int ts_rows_gather(ts_client_t *c, const char *bin, int item, const char *key,
                             const int64_t *index, size_t n, ts_items_t **out);
/*
 * Write rows (a tensor of the bin's dtype and shape [k, shape[1..]], k >= 0; its memory is read
 * during the call only) into the tensor bin at rows [start, start + k), in place. version (may be
 * NULL) gets the bin's new version. Errors: TS_ENOENT (no such bin), TS_EINVAL (not a tensor bin,
 * another dtype or shape, rows out of range), TS_ESAVEFAIL. Writes of several clients into
 * disjoint rows all land; into the same rows, the last the server handles wins. Added in 0.3.0.
 */
TS_EXTERN int ts_rows_write(ts_client_t *c, const char *bin, int64_t start, const ts_value_t *rows,
                            uint64_t *version);
/*
 * Asynchronous forms (see ts_result_cb): the callback is called exactly once, on the I/O thread,
 * with res->version (and res->n_items, the bin's items) for create and write, res->items (the
 * one tensor, as the blocking form's *out; set it to NULL to keep it) for read and gather. The
 * index and the rows are read by the I/O thread until the callback, unless flags has TS_COPY
 * (copied during the call). If one returns an error, the callback is never called.
 * Added in 0.3.0.
 */
TS_EXTERN int ts_tensor_bin_create_async(ts_client_t *c, const char *bin, ts_dtype_t dtype,
                                         int ndim, const int64_t *shape, ts_result_cb cb,
                                         void *arg);
TS_EXTERN int ts_rows_read_async(ts_client_t *c, const char *bin, int item, const char *key,
                                 int64_t start, int64_t end, ts_result_cb cb, void *arg);
TS_EXTERN int ts_rows_gather_async(ts_client_t *c, const char *bin, int item, const char *key,
                                   const int64_t *index, size_t n, unsigned flags, ts_result_cb cb,
                                   void *arg);
TS_EXTERN int ts_rows_write_async(ts_client_t *c, const char *bin, int64_t start,
                                  const ts_value_t *rows, unsigned flags, ts_result_cb cb,
                                  void *arg);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_H */
