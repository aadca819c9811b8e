/*
 * The per-thread message of the last failed call (ts_client_last_error): its one owner. api.c
 * sets it from a finished request, client.c from a failed ts_client_open; neither reaches into
 * the other for it.
 */
#include "internal.h"

/* The server's message for the last failed blocking call of this thread. */
static _Thread_local char tls_errmsg[TS_MAX_ERRMSG + 1];

void ts__set_last_error(const char *msg, size_t len)
{
    if (len > TS_MAX_ERRMSG)
        len = TS_MAX_ERRMSG;
    if (msg != NULL && len > 0)
        memcpy(tls_errmsg, msg, len);
    tls_errmsg[msg != NULL ? len : 0] = '\0';
}

const char *ts_client_last_error(void)
{
    return tls_errmsg;
}
