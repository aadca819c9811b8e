/*
 * tensord: command-line flags, defaults, and the life of the process (start the loop, run it
 * until SIGINT/SIGTERM, tear everything down, exit 0).
 */
#include "server.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

void tsd_config_defaults(tsd_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->host = TSD_DEFAULT_HOST;
    cfg->port = TSD_DEFAULT_PORT;
    cfg->max_frame = TS_DEFAULT_MAX_FRAME;
    cfg->max_output = TSD_DEFAULT_MAX_OUTPUT;
    cfg->max_clients = TSD_DEFAULT_MAX_CLIENTS;
    cfg->log_level = TSD_LOG_INFO;
    long pages = sysconf(_SC_PHYS_PAGES);
    long page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0)
        cfg->max_memory = (uint64_t)pages * (uint64_t)page / 4u * 3u;
}

static void usage(FILE *f)
{
    tsd_config d;
    tsd_config_defaults(&d);
    fprintf(f,
            "usage: tensord [flags]\n"
            "Holds named bins of tensor records in memory and serves them to tensorshare "
            "clients.\n\n"
            "  --port N            TCP port (0 = ephemeral)                    [%d]\n"
            "  --host ADDR         address to bind (IPv4 or IPv6)              [%s]\n"
            "  --unix PATH         also listen on a unix socket (a stale socket file is "
            "removed)\n"
            "  --port-file PATH    once listening, write the TCP port there (atomically)\n"
            "  --max-frame BYTES   largest request body                        [%llu = 1g]\n"
            "  --max-memory BYTES  item bytes held in bins, 0 = unlimited      [%llu = 3/4 of "
            "RAM]\n"
            "  --max-clients N     connections; more get TOO_MANY_CLIENTS      [%u]\n"
            "  --max-output BYTES  output queued per connection before it is cut off as a\n"
            "                      slow reader (SLOW_READER)                   [%llu = 256m]\n"
            "  --log-level LEVEL   error | warn | info | debug                  [info]\n"
            "  --help              this text\n"
            "  --version           print the version\n"
            "BYTES take a k, m or g suffix (powers of 1024). SIGINT or SIGTERM shut down "
            "cleanly.\n",
            d.port, d.host, (unsigned long long)d.max_frame, (unsigned long long)d.max_memory,
            d.max_clients, (unsigned long long)d.max_output);
}

/* Parse a decimal number with an optional k/m/g suffix. 0 or -1. */
static int parse_size(const char *s, uint64_t *out)
{
    if (s == NULL || *s < '0' || *s > '9')
        return -1;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno != 0)
        return -1;
    unsigned shift = 0;
    if (*end == 'k' || *end == 'K')
        shift = 10;
    else if (*end == 'm' || *end == 'M')
        shift = 20;
    else if (*end == 'g' || *end == 'G')
        shift = 30;
    if (shift != 0)
        end++;
    if (*end != '\0')
        return -1;
    if (shift != 0 && v > (UINT64_MAX >> shift))
        return -1;
    *out = (uint64_t)v << shift;
    return 0;
}

static int parse_level(const char *s, int *out)
{
    static const char *const names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = i;
            return 0;
        }
    }
    return -1;
}

/*
 * Parse argv into cfg. Returns 0 to run, 1 to exit successfully (help, version), -1 on a bad
 * flag (after printing why).
 */
static int parse_args(int argc, char **argv, tsd_config *cfg)
{
    for (int i = 1; i < argc; i++) {
        const char *flag = argv[i];
        const char *val = NULL;
        char name[32];
        const char *eq = strchr(flag, '=');
        if (strncmp(flag, "--", 2) == 0 && eq != NULL && (size_t)(eq - flag) < sizeof(name)) {
            memcpy(name, flag, (size_t)(eq - flag));
            name[eq - flag] = '\0';
            flag = name;
            val = eq + 1;
        }
        if (strcmp(flag, "--help") == 0 || strcmp(flag, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(flag, "--version") == 0) {
            printf("tensord %s\n", TS_VERSION_STRING);
            return 1;
        }
        static const char *const known[] = {"--port",        "--host",       "--unix",
                                            "--port-file",   "--max-frame",  "--max-memory",
                                            "--max-clients", "--max-output", "--log-level"};
        int is_known = 0;
        for (size_t k = 0; k < TS__ARRAY_SIZE(known); k++)
            is_known |= strcmp(flag, known[k]) == 0;
        if (!is_known) {
            fprintf(stderr, "tensord: unknown flag %s (see --help)\n", flag);
            return -1;
        }
        if (val == NULL) {
            if (i + 1 >= argc) {
                fprintf(stderr, "tensord: %s needs a value (see --help)\n", flag);
                return -1;
            }
            val = argv[++i];
        }
        uint64_t n = 0;
        int bad = 0;
        if (strcmp(flag, "--port") == 0) {
            bad = parse_size(val, &n) != 0 || n > 65535;
            cfg->port = (int)n;
        } else if (strcmp(flag, "--host") == 0) {
            cfg->host = val;
        } else if (strcmp(flag, "--unix") == 0) {
            cfg->unix_path = val;
        } else if (strcmp(flag, "--port-file") == 0) {
            cfg->port_file = val;
        } else if (strcmp(flag, "--max-frame") == 0) {
            bad = parse_size(val, &n) != 0 || n == 0;
            cfg->max_frame = n;
        } else if (strcmp(flag, "--max-memory") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->max_memory = n;
        } else if (strcmp(flag, "--max-clients") == 0) {
            bad = parse_size(val, &n) != 0 || n == 0 || n > UINT32_MAX;
            cfg->max_clients = (uint32_t)n;
        } else if (strcmp(flag, "--max-output") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->max_output = n;
        } else if (strcmp(flag, "--log-level") == 0) {
            bad = parse_level(val, &cfg->log_level) != 0;
        } else {
            fprintf(stderr, "tensord: unknown flag %s (see --help)\n", flag);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "tensord: bad value for %s: '%s'\n", flag, val);
            return -1;
        }
    }
    return 0;
}

int main(int argc, char **argv)
{
    tsd_config cfg;
    tsd_config_defaults(&cfg);
    int rc = parse_args(argc, argv, &cfg);
    if (rc != 0)
        return rc > 0 ? 0 : 2;

    /* A peer that vanishes mid-write must give EPIPE, not kill the daemon. */
    signal(SIGPIPE, SIG_IGN);

    uv_loop_t loop;
    if (uv_loop_init(&loop) != 0) {
        fprintf(stderr, "tensord: cannot create the event loop\n");
        return 1;
    }
    static tsd_server srv;
    rc = tsd_server_init(&srv, &loop, &cfg);
    if (rc != 0)
        tsd_server_stop(&srv);
    uv_run(&loop, UV_RUN_DEFAULT);
    /* Everything is closed once the loop runs out; a second pass catches late close callbacks. */
    if (uv_loop_close(&loop) != 0) {
        uv_run(&loop, UV_RUN_DEFAULT);
        if (uv_loop_close(&loop) != 0)
            tsd_log(TSD_LOG_WARN, "event loop closed with handles still open");
    }
    tsd_server_free(&srv);
    if (rc == 0)
        tsd_log(TSD_LOG_INFO, "shut down cleanly");
    return rc == 0 ? 0 : 1;
}
