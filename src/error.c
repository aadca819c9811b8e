/* Error names and messages, generated from the one TS_ERRNO_MAP table. */
#include "common.h"

const char *ts_strerror(int err)
{
    if (err == 0)
        return "success";
#define TS__ERR_MSG(name, value, msg)                                                              \
    if (err == (value))                                                                            \
        return msg;
    TS_ERRNO_MAP(TS__ERR_MSG)
#undef TS__ERR_MSG
    return "unknown error";
}

const char *ts_err_name(int err)
{
    if (err == 0)
        return "OK";
#define TS__ERR_NAME(name, value, msg)                                                             \
    if (err == (value))                                                                            \
        return #name;
    TS_ERRNO_MAP(TS__ERR_NAME)
#undef TS__ERR_NAME
    return "UNKNOWN";
}
