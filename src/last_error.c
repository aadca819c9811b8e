/*
 * The one error-message channel of the public API (ts_last_error, tensorshare.h "Error
 * messages"): a thread-local buffer that every module (client, rl/, batcher/, the libtorch shim)
 * writes before it reports a failure, and that callers read right after it. Thread-local like
 * errno, so that concurrent callers never see each other's messages and no lock is needed.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common.h"

static _Thread_local char tls_message[TS_MAX_ERROR_LEN + 1];

const char *ts_last_error(void)
{
    return tls_message;
}

/*
 * The message itself tells (not a flag beside it): every access then goes through the exported
 * ts_last_error(), so a process that holds two copies of this file (a test program that links
 * the static core beside libtensorshare.so) still sees one message and one answer.
 */
int ts_last_error_no_reply(void)
{
    const char *m = ts_last_error();
    if (strcmp(m, TS__NO_REPLY_MSG) == 0)
        return 1;
    size_t len = strlen(m);
    size_t pre = strlen(TS__NO_CONN_MSG_PREFIX);
    size_t post = strlen(TS__NO_CONN_MSG_SUFFIX);
    return len > pre + post && strncmp(m, TS__NO_CONN_MSG_PREFIX, pre) == 0 &&
           strcmp(m + len - post, TS__NO_CONN_MSG_SUFFIX) == 0;
}

void ts_set_last_error(const char *message)
{
    if (message == NULL) {
        tls_message[0] = '\0';
        return;
    }
    size_t len = strnlen(message, TS_MAX_ERROR_LEN);
    /* A message may be set from the buffer itself (ts_set_last_error(ts_last_error())). */
    memmove(tls_message, message, len);
    tls_message[len] = '\0';
}

void ts__set_errorf(const char *fmt, ...)
{
    char buf[TS_MAX_ERROR_LEN + 1];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    if (n < 0)
        buf[0] = '\0';
    ts_set_last_error(buf);
}

int ts__fail(int code, const char *fmt, ...)
{
    if (fmt == NULL) {
        ts_set_last_error(ts_strerror(code));
        return code;
    }
    char buf[TS_MAX_ERROR_LEN + 1];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    ts_set_last_error(n < 0 ? ts_strerror(code) : buf);
    return code;
}
