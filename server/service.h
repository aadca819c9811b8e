/*
 * Services in tensord (service.c): a connection registers as a server of a named service
 * (SVC_REGISTER), callers send requests to the service (SVC_CALL), tensord hands each call to
 * one server with room (an SVC_REQUEST push carrying the request's record, forwarded without a
 * copy) and routes the server's answer (SVC_REPLY) back to the caller as the CALL's reply.
 * Nothing is stored in bins. docs/PROTOCOL.md 8.51 to 8.54 and docs/SERVICES.md describe them.
 *
 * Thread: the loop thread, like everything that touches connections.
 */
#ifndef TSD_SERVICE_H
#define TSD_SERVICE_H

#include "server.h"

/* A decoded SVC_REGISTER. */
void tsd_svc_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);

/*
 * An SVC_CALL or SVC_REPLY upload has arrived (conn.c item_store): item holds one reference and
 * its length is reserved in the store; both are this function's. For SVC_CALL the record was
 * validated; for an SVC_REPLY with a status other than OK, item holds the message (1 to
 * TS_MAX_ERRMSG bytes, not a record). fixed holds the opcode's upload_fixed bytes.
 */
void tsd_svc_upload(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                    const uint8_t *fixed, tsd_item *item);

/*
 * c is closing: its registrations end (calls it held fail with SERVICE_GONE, and calls queued
 * for a service left without servers fail too unless they asked to wait), and the calls it made
 * are withdrawn (their answers, when they come, are dropped).
 */
void tsd_svc_conn_gone(tsd_server *srv, tsd_conn *c);
/*
 * tensord is stopping: answer SHUTTING_DOWN to each call c made that has no answer yet, then
 * drop them. Returns the number answered.
 */
size_t tsd_svc_conn_stop(tsd_server *srv, tsd_conn *c);

/* Counters for STATS. */
typedef struct tsd_svc_stats {
    uint64_t services;     /* services that exist (with servers, or calls waiting for one) */
    uint64_t servers;      /* registrations */
    uint64_t queued;       /* calls waiting for a server with room */
    uint64_t handed;       /* calls handed to a server and not yet answered by it */
    uint64_t calls;        /* calls received */
    uint64_t answered;     /* answers routed back to their callers */
    uint64_t gone;         /* calls failed with SERVICE_GONE */
    uint64_t timeouts;     /* calls answered TIMEOUT */
    uint64_t late_replies; /* answers dropped because their caller had left or timed out */
} tsd_svc_stats;
void tsd_svc_stats_get(const tsd_server *srv, tsd_svc_stats *st);

/* Free every service, registration and call (the connections are gone). */
void tsd_svc_free(tsd_server *srv);

#endif /* TSD_SERVICE_H */
