#!/usr/bin/env bash
# A relay's parts into $OUT, four a call (a call returns at most 64 MiB in 8 files of 16 MiB): `relay_collect.sh K`
# copies relay.json and parts 4K to 4K+3 of RELAY_OUT (default /tmp/relay_out, where job.sh packs them) and prints
# how many calls the whole relay takes. Locally, the parts of all calls go into one folder, which the next lease
# carries in as RELAY_IN (docs/relay.md).
set -euo pipefail
K="${1:?usage: relay_collect.sh K (the call: 0, 1, ...)}"
case "$K" in *[!0-9]*) echo "error: K takes a call number 0, 1, ..., got '$K'" >&2; exit 2 ;; esac
RELAY_OUT="${RELAY_OUT:-/tmp/relay_out}"
[ -e "$RELAY_OUT/relay.json" ] || { echo "error: $RELAY_OUT holds no relay.json: job.sh has not packed yet" >&2; exit 2; }
mapfile -t parts < <(cd "$RELAY_OUT" && ls relay.tar.* | sort)
cp "$RELAY_OUT/relay.json" "$OUT/"
for part in "${parts[@]:$(( K * 4 )):4}"; do cp "$RELAY_OUT/$part" "$OUT/"; done
echo "relay: ${#parts[@]} parts, $(( (${#parts[@]} + 3) / 4 )) calls; this call (K=$K) returns: $(cd "$OUT" && ls relay.* | tr '\n' ' ')"
