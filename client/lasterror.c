/*
 * The client's way into the one per-thread message of every module (ts_last_error,
 * src/last_error.c): api.c sets it from a finished request, client.c from a failed
 * ts_client_open, recv.c before a callback with a failure status.
 */
#include "internal.h"

void ts__set_last_error(const char *msg, size_t len)
{
    /* len bytes of msg, which need not be terminated there (a server message is at most
     * TS_MAX_ERRMSG bytes, below TS_MAX_ERROR_LEN). */
    char buf[TS_MAX_ERROR_LEN + 1];
    if (msg == NULL)
        len = 0;
    if (len > TS_MAX_ERROR_LEN)
        len = TS_MAX_ERROR_LEN;
    if (len > 0)
        memcpy(buf, msg, len);
    buf[len] = '\0';
    ts_set_last_error(buf);
}
