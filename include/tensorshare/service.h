/*
 * tensorshare services: request/reply through tensord without bins. A process registers as a
 * server of a named service; callers send requests (records) to the service; tensord hands each
 * request to one server that has room (several servers of one service share the load, each
 * holding at most its concurrency of unanswered calls) and routes the server's answer back to
 * the caller. Nothing is stored: a request exists while its call does. A server that disconnects
 * fails the calls it held at once (TS_ESERVICE), and the calls still queued go to the other
 * servers. docs/SERVICES.md describes them; the wire form is docs/PROTOCOL.md 8.51 to 8.54.
 *
 * Conventions are those of tensorshare.h: 0 or a negative TS_E* code with its reason in
 * ts_last_error(), out-parameters written only on success, borrowed pointer parameters, and
 * timeouts as tensorshare.h describes. Service names are NUL-terminated strings of 1 to 255
 * bytes (NULL or empty: TS_EINVAL; longer: TS_ENAMETOOLONG); they are names of their own, apart
 * from bins. With a cluster address, a service lives on the shard that owns its name, as a bin
 * of that name would. Added in 0.6.0.
 */
#ifndef TENSORSHARE_SERVICE_H
#define TENSORSHARE_SERVICE_H

#include <stddef.h>
#include <stdint.h>

#include "tensorshare/tensorshare.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------------------------------------
 * Calling a service
 */

/*
 * ts_call flags. TS_CALL_WAIT: when the service has no server, wait (up to the timeout) for one
 * to register instead of failing at once with TS_ENOENT. Added in 0.6.0.
 */
#define TS_CALL_WAIT 0x01u

/* The longest timeout of a call, in ms: 24 hours, tensord's limit. Added in 0.7.2. */
#define TS_CALL_MAX_TIMEOUT_MS 86400000u

/*
 * Call service with request (borrowed; sent from the caller's memory) and wait for its answer:
 * *answer is the server's answer record (free it with ts_value_free). timeout_ms covers the
 * whole call, waiting for a server with room included (tensord answers TS_ETIMEDOUT at it; when
 * tensord itself does not answer, paused or unreachable, the client gives up 100 ms later with
 * TS_ETIMEDOUT; Changed in 0.7.2: it waited the request timeout more): 1 to
 * TS_CALL_MAX_TIMEOUT_MS milliseconds, or TS_TIMEOUT_DEFAULT (the client's request timeout, at
 * most TS_CALL_MAX_TIMEOUT_MS); 0, more
 * than TS_CALL_MAX_TIMEOUT_MS, other negative values and TS_TIMEOUT_INFINITE give TS_EINVAL.
 * Errors: TS_ENOENT (no server serves the service, without TS_CALL_WAIT), TS_ETIMEDOUT (no
 * answer in time; a late answer is dropped), TS_ESERVICE (the server holding the call
 * disconnected or, without TS_CALL_WAIT, the last server left before the call was handed to
 * one), TS_ETOOMANY (this connection has --max-watch calls and waits pending), TS_EOOM,
 * TS_ESHUTDOWN, and any error the server answered with (ts_call_fail; its message in
 * ts_last_error()). Any thread, never from a client callback (TS_EDEADLK).
 * Added in 0.6.0.
 */
TS_EXTERN int ts_call(ts_client_t *c, const char *service, const ts_value_t *request,
                      int timeout_ms, unsigned flags, ts_value_t **answer);

/*
 * Asynchronous form: cb is called exactly once, on the client's I/O thread, with the status of
 * ts_call and, on success, res->items holding one item: the answer (res->items is freed after
 * the callback unless it sets it to NULL; res->version is the call's id). request is copied when
 * the call is made, unless copy_flags is TS_BORROW, in which case its tensors must stay valid
 * until cb. Any number of calls may be outstanding. Added in 0.6.0.
 */
TS_EXTERN int ts_call_async(ts_client_t *c, const char *service, const ts_value_t *request,
                            int timeout_ms, unsigned flags, unsigned copy_flags, ts_result_cb cb,
                            void *arg);

/* ---------------------------------------------------------------------------------------------
 * Serving a service
 */

typedef struct ts_service_s ts_service_t; /* a registration. Added in 0.6.0. */
typedef struct ts_call_s ts_call_t;       /* one call handed to a server. Added in 0.6.0. */

/* Calls a server holds unanswered by default (ts_service_options_t.concurrency). Added in 0.6.0. */
#define TS_SERVICE_DEFAULT_CONCURRENCY 64
/* The most calls one server may hold unanswered (the protocol's limit). Added in 0.6.0. */
#define TS_SERVICE_MAX_CONCURRENCY 65536

/*
 * A call for the service: request is the caller's record (yours: free it with ts_value_free),
 * call the handle to answer it with, exactly once, with ts_call_reply or ts_call_fail, from any
 * thread, now or later. Called on the client's I/O thread, one call at a time: keep it short
 * (hand the work to another thread), make no blocking calls on this client from it (TS_EDEADLK).
 * Added in 0.6.0.
 */
typedef void (*ts_service_cb)(ts_service_t *svc, ts_call_t *call, ts_value_t *request, void *arg);

/* Registration options; fill with ts_service_options_init. Added in 0.6.0. */
typedef struct ts_service_options_s {
    /* calls tensord hands this server before it has answered them (1 to
     * TS_SERVICE_MAX_CONCURRENCY); default TS_SERVICE_DEFAULT_CONCURRENCY */
    int concurrency;
} ts_service_options_t;

/* Fill opts with the defaults. Added in 0.6.0. */
TS_EXTERN void ts_service_options_init(ts_service_options_t *opts);

/*
 * Register this client as a server of service (opts copied; NULL for the defaults) and call cb
 * for each call tensord hands it. Blocks until tensord confirms. After a reconnection the client
 * registers again by itself (calls it held on the lost connection failed with TS_ESERVICE for
 * their callers; their answers are dropped). One registration per service per client: TS_EINVAL
 * when this client already serves it, or for bad options. Any thread, never from a client
 * callback (TS_EDEADLK). Added in 0.6.0.
 */
TS_EXTERN int ts_service_register(ts_service_t **out, ts_client_t *c, const char *service,
                                  const ts_service_options_t *opts, ts_service_cb cb, void *arg);

/*
 * Stop serving: no new calls are handed to this server (blocks until tensord confirms, at most
 * the request timeout; at once while the client is not connected, as the registration ended with
 * the connection and is not made again); the calls tensord hands until then still reach cb (they
 * are this server's to answer, like those handed before), calls already handed may still be
 * answered, and cb is not called again once this returns. Frees svc once its calls are answered.
 * NULL is a no-op. Any thread, never from a client callback. ts_client_free ends the client's
 * registrations itself and releases their handles: a handle is not used after it (calls already
 * handed stay valid: see ts_call_reply). Added in 0.6.0.
 */
TS_EXTERN void ts_service_unregister(ts_service_t *svc);

/*
 * Answer call with answer (copied now; it may be freed when this returns) and release call.
 * Non-blocking; any thread. An answer that cannot be delivered (the caller timed out or left,
 * the connection to tensord was lost, or the serving client was freed, even while this call ran)
 * is dropped and 0 returned. 0, or TS_EINVAL (NULL call or answer), TS_ENOMEM, an encoding
 * error; call is released in every case. When answer cannot be sent (NULL, or it cannot be
 * encoded, or there is no memory), the call is answered with an error instead, so that its
 * caller learns at once and the call stops counting against this server: the caller's ts_call
 * returns TS_ESERVER with "the service's answer could not be sent: " and this function's reason
 * in its ts_last_error(). Added in 0.6.0.
 */
TS_EXTERN int ts_call_reply(ts_call_t *call, const ts_value_t *answer);

/*
 * Answer call with an error: the caller's ts_call returns err with msg (NULL: ts_strerror(err);
 * at most 1024 bytes are sent) in its ts_last_error(). err is a TS_E* code with a wire status
 * (TS_EINVAL, TS_ENOENT, TS_ESERVER, TS_ETIMEDOUT, TS_EOOM, ...); others are sent as TS_ESERVER.
 * Release and return as ts_call_reply. Added in 0.6.0.
 */
TS_EXTERN int ts_call_fail(ts_call_t *call, int err, const char *msg);

/* The milliseconds the caller had left when the call was handed over. Added in 0.6.0. */
TS_EXTERN uint32_t ts_call_timeout_ms(const ts_call_t *call);
/* The call's id, unique on its tensord. Added in 0.6.0. */
TS_EXTERN uint64_t ts_call_id(const ts_call_t *call);

#ifdef __cplusplus
}
#endif

#endif /* TENSORSHARE_SERVICE_H */
