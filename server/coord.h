/*
 * Coordination primitives in tensord (coord.c): ADD (counters), PUT_IF (compare-and-set on a
 * bin's version), TAKE (a blocking GET that hands each item to one waiter, first come first
 * served), MGET (several bins in one round trip) and BARRIER (kept in the server, not a bin).
 * docs/PROTOCOL.md 8.39 to 8.43 and docs/COORDINATION.md describe them.
 *
 * Thread: the loop thread, like everything that touches the store.
 */
#ifndef TSD_COORD_H
#define TSD_COORD_H

#include "server.h"

/* A decoded coordination request: ADD, TAKE, MGET, BARRIER. */
void tsd_coord_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);

/*
 * A PUT_IF whose record has arrived and been validated (conn.c item_store): item holds one
 * reference and its length is reserved in the store; both are this function's. fixed holds the
 * TS_MSG_PUT_IF_FIXED bytes after the name (the expected version).
 */
void tsd_coord_put_if(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                      const uint8_t *fixed, tsd_item *item);

/*
 * A bin changed (notify.c tsd_notify_change): when takers wait for it and it has items, hand
 * them out in arrival order.
 */
void tsd_coord_changed(tsd_server *srv, const uint8_t *name, size_t len);
/* The housekeeping tick (server.c): answer TIMEOUT to the waits whose deadline passed. */
void tsd_coord_cron(tsd_server *srv);
/*
 * Drop c's pending TAKEs and barrier arrivals (a barrier arrival is withdrawn); answer each
 * SHUTTING_DOWN first when answer is 1 (tensord stopping). Returns how many there were.
 */
size_t tsd_coord_conn_drop(tsd_server *srv, tsd_conn *c, int answer);
/* Free the coordination state (barriers and waits) when the store goes. */
void tsd_coord_free(tsd_server *srv);

#endif /* TSD_COORD_H */
