/*
 * tensord: command-line flags, defaults, and the life of the process (start the loop, run it
 * until SIGINT/SIGTERM, tear everything down, exit 0). SIGHUP is ignored.
 *
 * Exit status: 0 after a clean shutdown; 1 when start-up or the final snapshot failed;
 * 2 for bad flags or an unsafe configuration (a --host that is not a numeric address, a
 * non-loopback --host without a token, a --unix socket another process answers on, a --save
 * directory that does not exist, a --save PATH that is a directory or that another tensord
 * holds, a --data-dir that cannot be made or that another tensord holds, --data-dir with
 * --save); 3 when the --save snapshot exists but is damaged or unreadable.
 */
#include "server.h"
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* Bytes; a HELLO body (4 bytes + token) must fit the pre-HELLO frame limit. */
#define TSD_MAX_TOKEN (TS_MAX_PREAUTH_BODY - 4)

/*
 * Bytes; the smallest --max-frame. Every body is held to --max-frame too, so below this a HELLO
 * with a long token, or a control request of full size, could never be sent.
 */
#define TSD_MIN_MAX_FRAME 4096u
_Static_assert(TSD_MIN_MAX_FRAME >= TS_MAX_PREAUTH_BODY && TSD_MIN_MAX_FRAME >= TS_MAX_CTRL_BODY,
               "HELLO and every control body fit the smallest --max-frame");

void tsd_config_defaults(tsd_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->host = TSD_DEFAULT_HOST;
    cfg->port = TSD_DEFAULT_PORT;
    cfg->max_frame = TS_DEFAULT_MAX_FRAME;
    cfg->max_output = TSD_DEFAULT_MAX_OUTPUT;
    cfg->max_clients = TSD_DEFAULT_MAX_CLIENTS;
    cfg->log_level = TSD_LOG_INFO;
    cfg->output_soft = TSD_DEFAULT_OUTPUT_SOFT;
    cfg->output_soft_seconds = TSD_DEFAULT_OUTPUT_SOFT_S;
    cfg->notify_backlog = TSD_DEFAULT_NOTIFY_BACKLOG;
    cfg->max_watch = TSD_DEFAULT_MAX_WATCH;
    cfg->hello_timeout_ms = TSD_DEFAULT_HELLO_MS;
    cfg->body_timeout_s = TSD_DEFAULT_BODY_TIMEOUT_S;
    cfg->max_unauth = TSD_DEFAULT_MAX_UNAUTH;
    cfg->shm_min = TSD_DEFAULT_SHM_MIN;
    cfg->save_interval_s = TSD_DEFAULT_SAVE_INTERVAL;
    cfg->stop_writes_on_save_error = 1;
    cfg->max_disk = TSD_MAX_DISK_DEFAULT;
    cfg->http_port = -1;
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
            "Listening:\n"
            "  --port N              TCP port (0 = ephemeral)                    [%d]\n"
            "  --host ADDR           address to bind (numeric IPv4 or IPv6)      [%s]\n"
            "                        anything but 127.0.0.0/8 or ::1 needs a token or --insecure\n"
            "  --unix PATH           also listen on a unix socket; a stale socket file is\n"
            "                        removed, one another process answers on is refused\n"
            "  --port-file PATH      once listening, write the TCP port there (atomically)\n"
            "  --http-port N         also serve GET /healthz, /readyz and /metrics (Prometheus)\n"
            "                        over HTTP on this port (0 = ephemeral)     [off]\n"
            "  --http-host ADDR      address of the HTTP listener (numeric)     [--host]\n"
            "  --http-port-file PATH once listening, write the HTTP port there (atomically)\n"
            "Authentication:\n"
            "  --auth-token-file PATH  shared secret every client must present in HELLO (trailing\n"
            "                        whitespace ignored; else TS_AUTH_TOKEN)    [none]\n"
            "  --insecure            allow a non-loopback --host without a token\n"
            "  --allow-plain-token   also accept the token in clear in HELLO (clients before\n"
            "                        0.5.0 send it so); by default only its proof is taken\n"
            "  --hello-timeout MS    close connections that do not complete HELLO in time,\n"
            "                        0 = never                                   [%u]\n"
            "Limits:\n"
            "  --max-frame BYTES     largest request body, at least 4096 (so that HELLO\n"
            "                        and every control request fit)              [%llu = 1g]\n"
            "  --max-memory BYTES    memory clients make tensord hold (items, bins, queued\n"
            "                        output, uploads, connections), 0 = unlimited [%llu = 3/4 of "
            "RAM]\n"
            "  --max-clients N       clients past HELLO; more get TOO_MANY_CLIENTS [%u]\n"
            "  --max-unauth-clients N  connections before HELLO, limited apart so they never\n"
            "                        take the places of clients               [%u]\n"
            "  --body-timeout S      close a connection whose frame (header or body) stops\n"
            "                        arriving for S seconds, 0 = never          [%u]\n"
            "  --max-output BYTES    unwritten output per connection before it is cut off as a\n"
            "                        slow reader (SLOW_READER), 0 = none may wait [%llu = 256m]\n"
            "  --output-soft BYTES   ... or when it stays above this for         [%llu = 64m]\n"
            "  --output-soft-seconds N  this many seconds, 0 BYTES = off          [%u]\n"
            "  --notify-backlog BYTES  unwritten output above which a listener's notifications\n"
            "                        are coalesced, one per bin                  [%llu = 1m]\n"
            "  --max-watch N         subscriptions plus pending waits and service calls per\n"
            "                        connection; more are answered INVALID (service calls:\n"
            "                        TOO_MANY_CLIENTS)                           [%u]\n",
            d.port, d.host, d.hello_timeout_ms, (unsigned long long)d.max_frame,
            (unsigned long long)d.max_memory, d.max_clients, d.max_unauth, d.body_timeout_s,
            (unsigned long long)d.max_output, (unsigned long long)d.output_soft,
            d.output_soft_seconds, (unsigned long long)d.notify_backlog, d.max_watch);
    tsd_tls_usage(f);
    tsd_shard_usage(f);
    /* In pieces: ISO C compilers need not take string literals over 4095 bytes. */
    fprintf(f,
            "Same host (unix sockets):\n"
            "  --shm-min BYTES       uploads on unix sockets at least this large are received\n"
            "                        into a memfd GET_REF hands out, 0 = never    [%llu = 1m]\n"
            "  --no-fds              refuse descriptors on unix sockets (no GET_REF/PUT_FD)\n",
            (unsigned long long)d.shm_min);
    fprintf(f,
            "Persistence:\n"
            "  --save PATH           load this snapshot at start, write it on shutdown, on SAVE\n"
            "                        and periodically (atomic: temporary file, fsync, rename);\n"
            "                        its directory must exist; PATH.lock keeps a second\n"
            "                        tensord from using the same PATH\n"
            "  --save-interval N     seconds between snapshots when data changed, 0 = only\n"
            "                        on SAVE and shutdown                        [%u]\n"
            "  --stop-writes-on-save-error yes|no  after a failed snapshot, refuse the requests\n"
            "                        that change bins (SAVE_FAILING) until one succeeds [yes]\n"
            "  --data-dir DIR        keep items in memory-mapped files DIR/<id>.tsi (created\n"
            "                        0700 when missing; DIR/LOCK keeps a second tensord out):\n"
            "                        bins survive restarts and a kill, may exceed RAM, and\n"
            "                        count against --max-disk, not --max-memory; not with --save\n"
            "  --data-min BYTES      items smaller than this stay in memory (lost at exit) [0]\n"
            "  --max-disk BYTES      bytes of files at most; a write past it is refused\n"
            "                        OUT_OF_MEMORY, 0 = unlimited    [3/4 of the free space]\n"
            "Other:\n"
            "  --log-level LEVEL     error | warn | info | debug                  [info]\n"
            "  --help                this text\n"
            "  --version             print the version\n"
            "BYTES take a k, m or g suffix (powers of 1024).\n"
            "Signals: SIGINT or SIGTERM shut down cleanly (writing the final snapshot with\n"
            "--save; more of them meanwhile are logged and change nothing). SIGHUP is ignored\n"
            "(logged), so a closed terminal does not stop tensord.\n"
            "Exit status: 0 clean shutdown, 1 failure, 2 bad flags or unsafe configuration\n"
            "(--unix in use, --save directory missing, --save a directory or held by another\n"
            "tensord, --data-dir unusable or held by another tensord, --data-dir with --save),\n"
            "3 damaged snapshot.\n",
            d.save_interval_s);
}

/*
 * 1 when host is a numeric IPv4 or IPv6 address, as the listeners take it (an IPv6 address may
 * carry a %zone); 0 otherwise (a host name such as localhost, a port, garbage). Names are not
 * resolved: a name could stand for several addresses, or another one after a DNS change.
 */
static int host_ok(const char *host)
{
    struct sockaddr_in6 a6;
    struct sockaddr_in a4;
    if (strchr(host, ':') != NULL)
        return uv_ip6_addr(host, 0, &a6) == 0;
    return uv_ip4_addr(host, 0, &a4) == 0;
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
static int parse_args(int argc, char **argv, tsd_config *cfg, const char **token_file)
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
        static const char *const no_value[] = {"--help", "--version", "--insecure", "--no-fds",
                                               "--allow-plain-token"};
        for (size_t k = 0; k < TS__ARRAY_SIZE(no_value) && val != NULL; k++) {
            if (strcmp(flag, no_value[k]) == 0) {
                fprintf(stderr, "tensord: %s takes no value (see --help)\n", flag);
                return -1;
            }
        }
        if (strcmp(flag, "--help") == 0 || strcmp(flag, "-h") == 0) {
            usage(stdout);
            return 1;
        }
        if (strcmp(flag, "--version") == 0) {
            printf("tensord %s\n", TS_VERSION_STRING);
            return 1;
        }
        if (strcmp(flag, "--insecure") == 0) {
            cfg->insecure = 1;
            continue;
        }
        if (strcmp(flag, "--no-fds") == 0) {
            cfg->no_fds = 1;
            continue;
        }
        if (strcmp(flag, "--allow-plain-token") == 0) {
            cfg->allow_plain_token = 1;
            continue;
        }
        int tls_rc = tsd_tls_flag(cfg, flag, val, argc, argv, &i);
        if (tls_rc < 0)
            return -1;
        if (tls_rc > 0)
            continue;
        int shard_rc = tsd_shard_flag(cfg, flag, val, argc, argv, &i);
        if (shard_rc < 0)
            return -1;
        if (shard_rc > 0)
            continue;
        static const char *const known[] = {"--port",           "--host",
                                            "--unix",           "--port-file",
                                            "--max-frame",      "--max-memory",
                                            "--max-clients",    "--max-output",
                                            "--log-level",      "--auth-token-file",
                                            "--output-soft",    "--output-soft-seconds",
                                            "--notify-backlog", "--hello-timeout",
                                            "--max-watch",      "--save",
                                            "--save-interval",  "--max-unauth-clients",
                                            "--body-timeout",   "--stop-writes-on-save-error",
                                            "--data-dir",       "--data-min",
                                            "--max-disk",       "--shm-min",
                                            "--http-port",      "--http-host",
                                            "--http-port-file"};
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
        const char *range = ""; /* said after a bad value, where the range is not obvious */
        if (strcmp(flag, "--port") == 0) {
            bad = parse_size(val, &n) != 0 || n > 65535;
            cfg->port = (int)n;
        } else if (strcmp(flag, "--host") == 0 || strcmp(flag, "--http-host") == 0) {
            if (!host_ok(val)) {
                fprintf(stderr,
                        "tensord: bad value for %s: '%s': only a numeric IPv4 or IPv6 address "
                        "is taken (such as 127.0.0.1, 0.0.0.0, ::1 or ::; no host name, no port)\n",
                        flag, val);
                return -1;
            }
            if (strcmp(flag, "--host") == 0)
                cfg->host = val;
            else
                cfg->http_host = val;
        } else if (strcmp(flag, "--unix") == 0) {
            cfg->unix_path = val;
        } else if (strcmp(flag, "--port-file") == 0) {
            cfg->port_file = val;
        } else if (strcmp(flag, "--http-port") == 0) {
            bad = parse_size(val, &n) != 0 || n > 65535;
            cfg->http_port = (int)n;
        } else if (strcmp(flag, "--http-port-file") == 0) {
            bad = val[0] == '\0';
            cfg->http_port_file = val;
        } else if (strcmp(flag, "--max-frame") == 0) {
            bad = parse_size(val, &n) != 0 || n < TSD_MIN_MAX_FRAME;
            range = " (at least 4096, so that HELLO and every control request fit)";
            cfg->max_frame = n;
        } else if (strcmp(flag, "--max-memory") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->max_memory = n;
        } else if (strcmp(flag, "--max-clients") == 0) {
            bad = parse_size(val, &n) != 0 || n == 0 || n > UINT32_MAX;
            cfg->max_clients = (uint32_t)n;
        } else if (strcmp(flag, "--max-unauth-clients") == 0) {
            bad = parse_size(val, &n) != 0 || n == 0 || n > UINT32_MAX;
            cfg->max_unauth = (uint32_t)n;
        } else if (strcmp(flag, "--body-timeout") == 0) {
            bad = parse_size(val, &n) != 0 || n > 86400u;
            cfg->body_timeout_s = (uint32_t)n;
        } else if (strcmp(flag, "--shm-min") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->shm_min = n;
        } else if (strcmp(flag, "--max-output") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->max_output = n;
        } else if (strcmp(flag, "--log-level") == 0) {
            bad = parse_level(val, &cfg->log_level) != 0;
        } else if (strcmp(flag, "--auth-token-file") == 0) {
            *token_file = val;
        } else if (strcmp(flag, "--output-soft") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->output_soft = n;
        } else if (strcmp(flag, "--output-soft-seconds") == 0) {
            bad = parse_size(val, &n) != 0 || n > 86400u * 365u;
            cfg->output_soft_seconds = (uint32_t)n;
        } else if (strcmp(flag, "--notify-backlog") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->notify_backlog = n;
        } else if (strcmp(flag, "--max-watch") == 0) {
            bad = parse_size(val, &n) != 0 || n == 0 || n > UINT32_MAX;
            cfg->max_watch = (uint32_t)n;
        } else if (strcmp(flag, "--hello-timeout") == 0) {
            bad = parse_size(val, &n) != 0 || n > UINT32_MAX;
            cfg->hello_timeout_ms = (uint32_t)n;
        } else if (strcmp(flag, "--save") == 0) {
            bad = val[0] == '\0';
            cfg->save_path = val;
        } else if (strcmp(flag, "--stop-writes-on-save-error") == 0) {
            bad = strcmp(val, "yes") != 0 && strcmp(val, "no") != 0;
            cfg->stop_writes_on_save_error = strcmp(val, "yes") == 0;
        } else if (strcmp(flag, "--data-dir") == 0) {
            bad = val[0] == '\0';
            cfg->data_dir = val;
        } else if (strcmp(flag, "--data-min") == 0) {
            bad = parse_size(val, &n) != 0;
            cfg->data_min = n;
        } else if (strcmp(flag, "--max-disk") == 0) {
            /* UINT64_MAX stands for the default (a share of the free space). */
            bad = parse_size(val, &n) != 0 || n == TSD_MAX_DISK_DEFAULT;
            cfg->max_disk = n;
        } else if (strcmp(flag, "--save-interval") == 0) {
            bad = parse_size(val, &n) != 0 || n > 86400u * 365u;
            cfg->save_interval_s = (uint32_t)n;
        } else {
            fprintf(stderr, "tensord: unknown flag %s (see --help)\n", flag);
            return -1;
        }
        if (bad) {
            fprintf(stderr, "tensord: bad value for %s: '%s'%s\n", flag, val, range);
            return -1;
        }
    }
    /*
     * Both would persist the same bins two ways, and a snapshot loaded over the data directory's
     * files (or the reverse) would duplicate or resurrect items.
     */
    if (cfg->data_dir != NULL && cfg->save_path != NULL) {
        fprintf(stderr, "tensord: --data-dir and --save cannot be used together (see --help)\n");
        return -1;
    }
    return 0;
}

/* The token, held for the life of the process (the config points into it). */
static uint8_t g_token[TSD_MAX_TOKEN + 1];

/* Drop trailing whitespace (a newline left by an editor or echo) from a token. */
static size_t token_trim(const uint8_t *t, size_t n)
{
    while (n > 0 && (t[n - 1] == '\n' || t[n - 1] == '\r' || t[n - 1] == ' ' || t[n - 1] == '\t'))
        n--;
    return n;
}

/*
 * Set cfg's token from --auth-token-file, else from TS_AUTH_TOKEN. 0, or -1 after printing
 * why (unreadable, empty, too long).
 */
static int load_token(tsd_config *cfg, const char *file)
{
    size_t n = 0;
    if (file != NULL) {
        int fd = open(file, O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
            fprintf(stderr, "tensord: --auth-token-file %s: %s\n", file, strerror(errno));
            return -1;
        }
        struct stat st;
        if (fstat(fd, &st) == 0 && (st.st_mode & 077) != 0)
            tsd_log(TSD_LOG_WARN, "--auth-token-file %s can be read by other users (chmod 600 it)",
                    file);
        for (;;) {
            ssize_t k = read(fd, g_token + n, sizeof(g_token) - n);
            if (k < 0 && errno == EINTR)
                continue;
            if (k < 0) {
                fprintf(stderr, "tensord: --auth-token-file %s: %s\n", file, strerror(errno));
                close(fd);
                return -1;
            }
            if (k == 0 || n + (size_t)k == sizeof(g_token)) {
                n += (size_t)k;
                break;
            }
            n += (size_t)k;
        }
        close(fd);
        n = token_trim(g_token, n);
        if (n > TSD_MAX_TOKEN) {
            fprintf(stderr, "tensord: --auth-token-file %s: the token is longer than %d bytes\n",
                    file, TSD_MAX_TOKEN);
            return -1;
        }
        if (n == 0) {
            fprintf(stderr,
                    "tensord: --auth-token-file %s is empty after trimming trailing whitespace\n",
                    file);
            return -1;
        }
    } else {
        const char *env = getenv("TS_AUTH_TOKEN");
        if (env == NULL || env[0] == '\0')
            return 0;
        n = token_trim((const uint8_t *)env, strlen(env));
        if (n == 0) {
            fprintf(stderr, "tensord: TS_AUTH_TOKEN is empty after trimming trailing "
                            "whitespace (unset it to run without a token)\n");
            return -1;
        }
        if (n > TSD_MAX_TOKEN) {
            fprintf(stderr, "tensord: TS_AUTH_TOKEN must hold 1 to %d bytes\n", TSD_MAX_TOKEN);
            return -1;
        }
        memcpy(g_token, env, n);
    }
    cfg->auth_token = g_token;
    cfg->auth_token_len = n;
    return 0;
}

/* 1 when host is a loopback address (127.0.0.0/8, ::1, or ::ffff:127.x.y.z). */
static int is_loopback(const char *host)
{
    struct in_addr a4;
    struct in6_addr a6;
    if (inet_pton(AF_INET, host, &a4) == 1)
        return (ntohl(a4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &a6) == 1) {
        static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (memcmp(&a6, &in6addr_loopback, sizeof(a6)) == 0)
            return 1;
        return memcmp(a6.s6_addr, v4mapped, 12) == 0 && a6.s6_addr[12] == 127;
    }
    return 0;
}

/*
 * Every connection is a file descriptor: raise the soft limit to the hard one, so that the
 * process limit rather than a low shell default caps --max-clients.
 */
static void raise_nofile(const tsd_config *cfg)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return;
    if (rl.rlim_cur < rl.rlim_max) {
        rlim_t want = rl.rlim_max;
        if (want == RLIM_INFINITY || want > ((rlim_t)1 << 20))
            want = (rlim_t)1 << 20;
        if (want > rl.rlim_cur) {
            rl.rlim_cur = want;
            (void)setrlimit(RLIMIT_NOFILE, &rl);
            (void)getrlimit(RLIMIT_NOFILE, &rl);
        }
    }
    /* Connections before and after HELLO are limited separately, so both take descriptors. */
    uint64_t need = (uint64_t)cfg->max_clients + cfg->max_unauth + 64;
    if (rl.rlim_cur != RLIM_INFINITY && need > rl.rlim_cur)
        tsd_log(TSD_LOG_WARN,
                "the file descriptor limit (%llu) is below --max-clients (%u) + "
                "--max-unauth-clients (%u) + 64: accepting will pause when it runs out",
                (unsigned long long)rl.rlim_cur, cfg->max_clients, cfg->max_unauth);
}

int main(int argc, char **argv)
{
    ts__alloc_count_enable(); /* STATS "allocations" */
    tsd_config cfg;
    tsd_config_defaults(&cfg);
    const char *token_file = NULL;
    int rc = parse_args(argc, argv, &cfg, &token_file);
    if (rc != 0)
        return rc > 0 ? 0 : TSD_EXIT_USAGE;
    /* From here on, warnings go through the log, in its format and at its level. */
    tsd_log_set_level(cfg.log_level);
    if (load_token(&cfg, token_file) != 0)
        return TSD_EXIT_USAGE;
    if (tsd_tls_setup(&cfg) != 0)
        return TSD_EXIT_USAGE;
    if (!is_loopback(cfg.host) && cfg.auth_token == NULL && !cfg.insecure) {
        fprintf(stderr,
                "tensord: refusing to listen on %s without authentication: anyone who can reach "
                "it could read and replace every bin.\n"
                "Give a token (--auth-token-file PATH or TS_AUTH_TOKEN), listen on 127.0.0.1, "
                "or pass --insecure if the network is trusted.\n",
                cfg.host);
        return TSD_EXIT_USAGE;
    }
    if (!is_loopback(cfg.host) && cfg.auth_token == NULL)
        tsd_log(TSD_LOG_WARN, "--insecure: listening on %s without authentication", cfg.host);
    raise_nofile(&cfg);
    /* The shard map (--shard, --cluster-map): a bad one is a usage error, like a bad flag. */
    if (tsd_shard_setup(&cfg) != 0)
        return TSD_EXIT_USAGE;
    tsd_shard_log(&cfg);

    /* A peer that vanishes mid-write must give EPIPE, not kill the daemon. */
    signal(SIGPIPE, SIG_IGN);
    /* SIGHUP is ignored, during start-up too (the loop logs it once it runs). */
    signal(SIGHUP, SIG_IGN);

    uv_loop_t loop;
    if (uv_loop_init(&loop) != 0) {
        fprintf(stderr, "tensord: cannot create the event loop\n");
        return 1;
    }
    static tsd_server srv;
    rc = tsd_server_init(&srv, &loop, &cfg);
    if (rc != 0) {
        tsd_server_stop(&srv);
    } else {
        /*
         * Testing aid: TSD_FAIL_ALLOC_AFTER=N makes the N-th allocation after start-up fail
         * (once), so tests can check that every allocation of request handling fails safely.
         */
        srv.alloc_base = ts__alloc_count();
        const char *fa = getenv("TSD_FAIL_ALLOC_AFTER");
        if (fa != NULL && fa[0] != '\0') {
            char *end;
            long n = strtol(fa, &end, 10);
            if (*end == '\0' && n > 0) {
                tsd_log(TSD_LOG_WARN,
                        "TSD_FAIL_ALLOC_AFTER=%ld: allocation %ld will fail "
                        "(a testing aid)",
                        n, n);
                ts__alloc_fail_after(n);
            }
        }
    }
    uv_run(&loop, UV_RUN_DEFAULT);
    /* The HTTP handles served until now without holding the loop: they close with the rest. */
    tsd_http_close(&srv);
    /* The final snapshot is durable now: the signals can be let go (ignored until exit). */
    tsd_server_release_signals(&srv);
    uv_run(&loop, UV_RUN_DEFAULT);
    /* Everything is closed once the loop runs out; a second pass catches late close callbacks. */
    if (uv_loop_close(&loop) != 0) {
        uv_run(&loop, UV_RUN_DEFAULT);
        if (uv_loop_close(&loop) != 0)
            tsd_log(TSD_LOG_WARN, "event loop closed with handles still open");
    }
    tsd_server_free(&srv);
    tsd_shard_cleanup(&cfg);
    tsd_tls_cleanup(&cfg);
    memset(g_token, 0, sizeof(g_token));
    if (rc == 0 && srv.exit_code == 0)
        tsd_log(TSD_LOG_INFO, "shut down cleanly");
    return rc == 0 ? srv.exit_code : (srv.exit_code != 0 ? srv.exit_code : 1);
}
