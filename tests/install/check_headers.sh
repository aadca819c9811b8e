#!/bin/sh
# check_headers.sh INCLUDE_DIR VERSION: the installed headers keep the API conventions that a
# compiler cannot check (docs/DESIGN.md "API conventions"):
# - every function, typedef, enum and macro constant says in which version it appeared, as
#   "Added in X.Y.Z." in its own comment, the comment of its group (declarations without a blank
#   line between them) or a comment on its line, and no version is newer than VERSION;
# - version.h carries VERSION;
# - no removed name or implementation switch is documented as API.
set -eu
dir=$1
version=$2
status=0
for h in "$dir"/tensorshare/*.h; do
    out=$(awk -v file="$h" -v version="$version" '
        function vnum(v,  p) { split(v, p, "."); return p[1] * 1000000 + p[2] * 1000 + p[3] }
        {
            line = $0
            if (line ~ /[Aa]dded in/) {
                s = line
                while (match(s, /[Aa]dded in [0-9.]*/)) {
                    tok = substr(s, RSTART, RLENGTH)
                    s = substr(s, RSTART + RLENGTH)
                    if (tok !~ /^Added in [0-9]+\.[0-9]+\.[0-9]+\.?$/) {
                        printf "%s:%d: malformed since note: %s\n", file, NR, tok
                        continue
                    }
                    v = tok; sub(/^Added in /, "", v); sub(/\.$/, "", v)
                    if (vnum(v) > vnum(version))
                        printf "%s:%d: %s is newer than the project version %s\n", file, NR, tok, version
                }
            }
        }
        /^[ \t]*$/ { covered = 0; next }
        {
            if (line ~ /\/\*/ && line !~ /^(TS_EXTERN|typedef|#define)/) { incomment = 1; ctext = "" }
            if (incomment) {
                ctext = ctext " " line
                if (line ~ /\*\//) {
                    incomment = 0
                    covered = (ctext ~ /Added in [0-9]+\.[0-9]+\.[0-9]+\./)
                }
                next
            }
        }
        /^TS_EXTERN|^typedef|^#define/ {
            if (line ~ /^#define[ \t]+(TENSORSHARE_[A-Z_]*H|TS_EXTERN|TS__)/) next
            if (!covered && line !~ /Added in [0-9]+\.[0-9]+\.[0-9]+\./)
                printf "%s:%d: no \"Added in\" for: %s\n", file, NR, line
        }
    ' "$h")
    if [ -n "$out" ]; then
        printf '%s\n' "$out"
        status=1
    fi
done
if ! grep -q "#define TS_VERSION_STRING \"$version\"" "$dir/tensorshare/version.h"; then
    echo "check_headers: version.h does not say $version"
    status=1
fi
if grep -nE 'ts_(client|batcher|torch)_last_error|TS_CLIENT_DIRECT|getenv' "$dir"/tensorshare/*.h; then
    echo "check_headers: a removed name or an implementation switch is in a public header"
    status=1
fi
if [ "$status" -eq 0 ]; then
    echo "check_headers: every declaration has its version; version.h says $version"
fi
exit $status
