/*
 * Coordination primitives in tensord (coord.c): ADD (counters), PUT_IF (compare-and-set on a
 * bin's version), TAKE (a blocking GET that hands each item to one waiter, first come first
 * served), MGET (several bins in one round trip) and BARRIER (kept in the server, not a bin).
 * docs/PROTOCOL.md 8.33 to 8.37 and docs/COORDINATION.md describe them.
 *
 * Thread: the loop thread, like everything that touches the store.
 */
#ifndef TSD_COORD_H
#define TSD_COORD_H

#include "server.h"

/* A decoded coordination request (ADD; TAKE, MGET and BARRIER as they are added). */
void tsd_coord_dispatch(tsd_conn *c, const ts__hdr *h, const ts__msg *m);

/*
 * A PUT_IF whose record has arrived and been validated (conn.c item_store): item holds one
 * reference and its length is reserved in the store; both are this function's. fixed holds the
 * TS_MSG_PUT_IF_FIXED bytes after the name (the expected version).
 */
void tsd_coord_put_if(tsd_conn *c, const ts__hdr *h, const uint8_t *name, size_t name_len,
                      const uint8_t *fixed, tsd_item *item);

#endif /* TSD_COORD_H */
