/*
 * Placements: where the batcher's replicas run. "cpu[:N]" is N CPU replicas; "cuda:I[*K]" is K
 * replicas on CUDA device I; "cuda[*K]" is K on every CUDA device; "cuda/N" is N spread over the
 * devices in turn; parts are comma-separated.
 */
#include "batcher_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The largest device index or replica count a placement may name; far above any real machine. */
#define TS__PLACEMENT_MAX_NUM 1000000

/* Parse a non-negative decimal number at *p (advancing it). 0 or -1. */
static int parse_num(const char **p, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(*p, &end, 10);
    if (end == *p || errno != 0 || v < 0 || v > TS__PLACEMENT_MAX_NUM)
        return -1;
    *p = end;
    *out = v;
    return 0;
}

/* Append a device. 0, or -1 when there are too many. */
static int add_dev(char (*devs)[TS__DEVICE_LEN], int *n, const char *kind, long index)
{
    if (*n >= TS__MAX_REPLICAS)
        return -1;
    if (index < 0)
        snprintf(devs[*n], TS__DEVICE_LEN, "%s", kind);
    else
        snprintf(devs[*n], TS__DEVICE_LEN, "%s:%ld", kind, index);
    (*n)++;
    return 0;
}

int ts__placement_parse(const char *spec, int cuda_devices, char (*devs)[TS__DEVICE_LEN], int *n)
{
    *n = 0;
    const char *p = spec != NULL && *spec ? spec : "cpu";
    while (*p) {
        long a = -1, k = 1;
        int bad = 0;
        if (strncmp(p, "cpu", 3) == 0) {
            p += 3;
            if (*p == ':')
                p++, bad = parse_num(&p, &k) != 0 || k < 1;
            for (long i = 0; !bad && i < k; i++)
                bad = add_dev(devs, n, "cpu", -1) != 0;
        } else if (strncmp(p, "cuda", 4) == 0) {
            p += 4;
            int all = 1, rr = 0;
            if (*p == ':') {
                p++;
                all = 0;
                bad = parse_num(&p, &a) != 0;
            }
            if (!bad && *p == '*')
                p++, bad = parse_num(&p, &k) != 0 || k < 1;
            else if (!bad && *p == '/' && all)
                p++, rr = 1, bad = parse_num(&p, &k) != 0 || k < 1;
            if (!bad && all && cuda_devices <= 0) {
                ts__batcher_set_err("placement '%s': no CUDA device available", spec);
                return TS_ENOTSUP;
            }
            if (!bad && !all && cuda_devices > 0 && a >= cuda_devices) {
                ts__batcher_set_err("placement '%s': cuda:%ld does not exist (%d devices)", spec, a,
                                    cuda_devices);
                return TS_EINVAL;
            }
            if (!bad && rr) {
                for (long i = 0; !bad && i < k; i++)
                    bad = add_dev(devs, n, "cuda", i % cuda_devices) != 0;
            } else if (!bad && all) {
                for (long d = 0; !bad && d < cuda_devices; d++)
                    for (long i = 0; !bad && i < k; i++)
                        bad = add_dev(devs, n, "cuda", d) != 0;
            } else {
                for (long i = 0; !bad && i < k; i++)
                    bad = add_dev(devs, n, "cuda", a) != 0;
            }
        } else {
            bad = 1;
        }
        if (!bad && *p == ',' && p[1] != '\0')
            p++;
        else if (!bad && *p != '\0')
            bad = 1;
        if (bad) {
            ts__batcher_set_err(
                "placement '%s': expected cpu[:N], cuda:I[*K], cuda[*K] or cuda/N, comma-"
                "separated, at most %d replicas",
                spec, TS__MAX_REPLICAS);
            return TS_EINVAL;
        }
    }
    return 0;
}
